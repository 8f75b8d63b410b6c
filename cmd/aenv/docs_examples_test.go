package main

import (
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"testing"
)

// docExample is one aenv command line from the docs.
type docExample struct {
	where string // file:line
	words []string
	// ref is an inline mention (`aenv pull --user`): the command and its flags must
	// exist; values and arguments are prose.
	ref bool
}

var inlineAenv = regexp.MustCompile("`(aenv [^`]+)`")

// docExamples extracts the aenv command lines of docs/*.md and README.md: every line of a
// fenced block that runs aenv (after a prompt, sudo, a pipe, $( or &&), and every inline
// code span that is a whole aenv command.
func docExamples(t *testing.T) []docExample {
	t.Helper()
	files, _ := filepath.Glob("../../docs/*.md")
	files = append(files, "../../README.md")
	var out []docExample
	for _, f := range files {
		raw, err := os.ReadFile(f)
		if err != nil {
			t.Fatal(err)
		}
		fenced, lang := false, ""
		for n, line := range strings.Split(string(raw), "\n") {
			where := filepath.Base(f) + ":" + itoa(n+1)
			if strings.HasPrefix(strings.TrimSpace(line), "```") {
				fenced = !fenced
				lang = strings.TrimPrefix(strings.TrimSpace(line), "```")
				continue
			}
			if fenced {
				if lang == "" || lang == "sh" || lang == "bash" || lang == "shell" || lang == "console" {
					// [--flag VALUE] marks an optional part: shown, so checked.
					line = strings.NewReplacer("[", "", "]", "").Replace(line)
					for _, cmd := range aenvCommands(line) {
						out = append(out, docExample{where: where, words: cmd})
					}
				}
				continue
			}
			for _, m := range inlineAenv.FindAllStringSubmatch(line, -1) {
				span := m[1]
				// Synopses with alternatives or elisions are prose, not commands.
				if strings.ContainsAny(span, "|<>…") || strings.Contains(span, "...") {
					continue
				}
				span = regexp.MustCompile(`\[[^\]]*\]`).ReplaceAllString(span, "")
				for _, cmd := range aenvCommands(span) {
					out = append(out, docExample{where, cmd, true})
				}
			}
		}
	}
	return out
}

func itoa(n int) string { return strconv.Itoa(n) }

// aenvCommands splits a shell line into its aenv invocations' words.
func aenvCommands(line string) [][]string {
	if i := strings.Index(line, " #"); i >= 0 {
		line = line[:i]
	}
	if strings.HasPrefix(strings.TrimSpace(line), "#") {
		return nil
	}
	words := shellSplit(line)
	var out [][]string
	for i := 0; i < len(words); i++ {
		w := words[i]
		if w != "aenv" && !strings.HasSuffix(w, "/aenv") && !strings.HasSuffix(w, "$(aenv") {
			continue
		}
		if i > 0 && !slicesContains([]string{"$", "sudo", "|", "&&", ";", "||", "exec", "env"}, words[i-1]) && !strings.Contains(words[i-1], "=") {
			continue // "aenv" as an argument of something else
		}
		var cmd []string
		for j := i + 1; j < len(words); j++ {
			x := words[j]
			if slicesContains([]string{"|", "&&", ";", "||", ">", "2>", ">>", "&", "<"}, x) || strings.HasPrefix(x, ">") || strings.HasPrefix(x, "2>") {
				break
			}
			if strings.HasSuffix(x, ")") && !strings.HasPrefix(x, "(") {
				cmd = append(cmd, strings.TrimSuffix(x, ")"))
				break
			}
			cmd = append(cmd, x)
		}
		out = append(out, cmd)
	}
	return out
}

func slicesContains(s []string, v string) bool { return slices.Contains(s, v) }

// shellSplit splits on blanks, keeping quoted words whole (quotes removed).
func shellSplit(s string) []string {
	var (
		out   []string
		cur   strings.Builder
		quote rune
		in    bool
	)
	for _, r := range s {
		switch {
		case quote != 0:
			if r == quote {
				quote = 0
			} else {
				cur.WriteRune(r)
			}
		case r == '\'' || r == '"':
			quote, in = r, true
		case r == ' ' || r == '\t':
			if in {
				out = append(out, cur.String())
				cur.Reset()
				in = false
			}
		default:
			cur.WriteRune(r)
			in = true
		}
	}
	if in {
		out = append(out, cur.String())
	}
	return out
}

// TestDocsExamplesParse checks every aenv command the docs show against the CLI itself:
// the command exists, every flag exists and takes the value given, and the arguments
// are as many as the command accepts. A renamed command or flag fails here.
func TestDocsExamplesParse(t *testing.T) {
	ex := docExamples(t)
	if len(ex) < 20 {
		t.Fatalf("only %d examples found in the docs", len(ex))
	}
	for _, e := range ex {
		root := newRootCmd()
		cmd, rest, err := root.Find(e.words)
		if err != nil {
			t.Errorf("%s: aenv %s: %v", e.where, strings.Join(e.words, " "), err)
			continue
		}
		if e.ref {
			for _, w := range rest {
				if w == "--" { // the end of the flags: a command's own arguments follow
					break
				}
				name, _, _ := strings.Cut(strings.TrimLeft(w, "-"), "=")
				if strings.HasPrefix(w, "--") && cmd.Flags().Lookup(name) == nil {
					t.Errorf("%s: aenv %s: no flag --%s", e.where, strings.Join(e.words, " "), name)
				}
				if strings.HasPrefix(w, "-") && !strings.HasPrefix(w, "--") && len(name) == 1 && cmd.Flags().ShorthandLookup(name) == nil {
					t.Errorf("%s: aenv %s: no flag -%s", e.where, strings.Join(e.words, " "), name)
				}
			}
			continue
		}
		if err := cmd.ParseFlags(rest); err != nil {
			t.Errorf("%s: aenv %s: %v", e.where, strings.Join(e.words, " "), err)
			continue
		}
		if h, _ := cmd.Flags().GetBool("help"); h {
			continue
		}
		if cmd.Args != nil {
			if err := cmd.Args(cmd, cmd.Flags().Args()); err != nil {
				t.Errorf("%s: aenv %s: %v", e.where, strings.Join(e.words, " "), err)
			}
		} else if !cmd.Runnable() {
			t.Errorf("%s: aenv %s: not a command that runs", e.where, strings.Join(e.words, " "))
		}
	}
}
