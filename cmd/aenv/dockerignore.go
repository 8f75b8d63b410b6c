package main

import (
	"bufio"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"path"
	"path/filepath"
	"regexp"
	"strings"
)

// ignorePattern is one line of a .dockerignore file.
type ignorePattern struct {
	text      string
	re        *regexp.Regexp
	exception bool // the line started with '!'
}

// dockerignore excludes build-context paths the way Docker's .dockerignore does
// (moby/patternmatcher): patterns are cleaned and relative to the context root, `*` and
// `?` do not cross '/', `**` matches any number of directories, a pattern that matches a
// directory excludes everything under it, and the last matching line wins, so a `!`
// line brings back what an earlier line excluded.
type dockerignore struct {
	patterns []ignorePattern
}

// loadDockerignore reads the ignore file a build of dockerfile in ctxDir uses: BuildKit's
// <Dockerfile>.dockerignore next to the Dockerfile when there is one, else
// CONTEXT/.dockerignore. No file is an empty matcher.
func loadDockerignore(ctxDir, dockerfile string) (*dockerignore, string, error) {
	for _, p := range []string{dockerfile + ".dockerignore", filepath.Join(ctxDir, ".dockerignore")} {
		f, err := os.Open(p)
		if errors.Is(err, fs.ErrNotExist) {
			continue
		}
		if err != nil {
			return nil, "", err
		}
		di, err := parseDockerignore(f)
		f.Close()
		if err != nil {
			return nil, "", fmt.Errorf("%s: %w", p, err)
		}
		return di, p, nil
	}
	return &dockerignore{}, "", nil
}

func parseDockerignore(r io.Reader) (*dockerignore, error) {
	di := &dockerignore{}
	sc := bufio.NewScanner(r)
	for no := 1; sc.Scan(); no++ {
		line := strings.TrimSpace(sc.Text())
		if line == "" || strings.HasPrefix(line, "#") {
			continue
		}
		exc := false
		if line[0] == '!' {
			exc, line = true, strings.TrimSpace(line[1:])
			if line == "" {
				return nil, fmt.Errorf("line %d: '!' without a pattern", no)
			}
		}
		line = filepath.ToSlash(filepath.Clean(line))
		if len(line) > 1 && line[0] == '/' {
			line = line[1:]
		}
		re, err := ignoreRegexp(line)
		if err != nil {
			return nil, fmt.Errorf("line %d: %q: %w", no, line, err)
		}
		di.patterns = append(di.patterns, ignorePattern{text: line, re: re, exception: exc})
	}
	return di, sc.Err()
}

// ignoreRegexp compiles a pattern as patternmatcher does.
func ignoreRegexp(p string) (*regexp.Regexp, error) {
	var b strings.Builder
	b.WriteString("^")
	for i := 0; i < len(p); i++ {
		switch c := p[i]; c {
		case '*':
			if i+1 < len(p) && p[i+1] == '*' {
				i++
				if i+1 < len(p) && p[i+1] == '/' {
					i++
				}
				if i+1 >= len(p) {
					b.WriteString(".*")
				} else {
					b.WriteString("(.*/)?")
				}
			} else {
				b.WriteString("[^/]*")
			}
		case '?':
			b.WriteString("[^/]")
		case '\\':
			if i+1 >= len(p) {
				return nil, errors.New("trailing backslash")
			}
			i++
			b.WriteString(regexp.QuoteMeta(p[i : i+1]))
		case '[':
			end := strings.IndexByte(p[i+1:], ']')
			if end < 0 {
				return nil, errors.New("unterminated [")
			}
			class := p[i+1 : i+1+end]
			if strings.HasPrefix(class, "!") {
				class = "^" + class[1:]
			}
			b.WriteString("[" + class + "]")
			i += end + 1
		default:
			b.WriteString(regexp.QuoteMeta(string(c)))
		}
	}
	b.WriteString("$")
	return regexp.Compile(b.String())
}

// excluded reports whether the context-relative, slash-separated path rel stays out of
// the build: the last line matching it or one of its parent directories decides.
func (di *dockerignore) excluded(rel string) bool {
	if di == nil || rel == "." {
		return false
	}
	parents := []string{}
	for d := path.Dir(rel); d != "." && d != "/"; d = path.Dir(d) {
		parents = append(parents, d)
	}
	out := false
	for _, p := range di.patterns {
		if p.exception != out {
			continue // this line cannot change the outcome
		}
		match := p.re.MatchString(rel)
		for _, d := range parents {
			if match {
				break
			}
			match = p.re.MatchString(d)
		}
		if match {
			out = !p.exception
		}
	}
	return out
}

// hasExceptions reports whether a '!' line could bring back something under an excluded
// directory (then the directory must still be walked).
func (di *dockerignore) hasExceptions() bool {
	for _, p := range di.patterns {
		if p.exception {
			return true
		}
	}
	return false
}
