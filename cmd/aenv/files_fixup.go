package main

import (
	"bytes"
	"context"
	"fmt"
	"io/fs"
	"strings"
)

// uploadedMode is the mode envd gives every file it writes (E2B's /files has no mode).
const uploadedMode = 0o644

// remoteFixups is what an upload must do after envd's /files wrote the file contents: set the
// modes it cannot carry and create symlinks, which it cannot write.
type remoteFixups struct {
	modes map[string]fs.FileMode
	links [][2]string // path, target
}

func (f *remoteFixups) mode(path string, m fs.FileMode) {
	if m.Perm() == uploadedMode {
		return
	}
	if f.modes == nil {
		f.modes = map[string]fs.FileMode{}
	}
	f.modes[path] = m.Perm()
}

func (f *remoteFixups) link(path, target string) { f.links = append(f.links, [2]string{path, target}) }

// maxScript keeps each command line well under Linux's 128 KiB limit on one argument.
const maxScript = 64 << 10

// scripts are shell command lines that together do every fixup; none when there is nothing to do.
func (f remoteFixups) scripts() []string {
	var lines []string
	for p, m := range f.modes {
		lines = append(lines, fmt.Sprintf("chmod %o %s", m, quoteOne(p)))
	}
	for _, l := range f.links {
		lines = append(lines, "mkdir -p "+quoteOne(dirOf(l[0]))+" && ln -sfn "+quoteOne(l[1])+" "+quoteOne(l[0]))
	}
	var out []string
	cur := ""
	for _, l := range lines {
		if cur != "" && len(cur)+len(l)+4 > maxScript {
			out = append(out, cur)
			cur = ""
		}
		if cur != "" {
			cur += " && "
		}
		cur += l
	}
	if cur != "" {
		out = append(out, cur)
	}
	return out
}

func quoteOne(s string) string { return "'" + strings.ReplaceAll(s, "'", `'\''`) + "'" }

func dirOf(p string) string {
	if i := strings.LastIndexByte(p, '/'); i > 0 {
		return p[:i]
	}
	return "/"
}

// applyFixups runs the fixups in the sandbox as user (who owns the uploaded files).
func (e *envdClient) applyFixups(ctx context.Context, f remoteFixups, user string) error {
	for _, script := range f.scripts() {
		var out bytes.Buffer
		code, err := e.run(ctx, script, nil, "", user, nil, &out, &out)
		if err != nil {
			return fmt.Errorf("set modes and symlinks in %s: %w", e.id, err)
		}
		if code != 0 {
			return fmt.Errorf("set modes and symlinks in %s: exit status %d: %s", e.id, code, strings.TrimSpace(out.String()))
		}
	}
	return nil
}
