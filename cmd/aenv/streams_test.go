package main

import (
	"bytes"
	"context"
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"testing"

	"github.com/spf13/cobra"
)

// streamCase is one command's success path: what its result on stdout looks like, and what
// (if anything) it may say on stderr beside it.
type streamCase struct {
	args   []string // {id}, {url}, {key}, {dir}, {layout} are replaced
	stdout string   // regexp the whole stdout must match
	stderr string   // regexp stderr must match; "" means stderr stays empty
}

// TestOutputStreams runs each command's success path and checks where its output goes: the
// result (IDs, tables, JSON, "killed ID", where a file went) on stdout, so `x=$(aenv ...)`
// and pipes get it; progress, build logs and notes on stderr.
func TestOutputStreams(t *testing.T) {
	layout := pullTestLayout(t)
	dir := t.TempDir()
	raw := filepath.Join(dir, "disk.raw")
	if err := os.WriteFile(raw, bytes.Repeat([]byte{7}, 1<<20), 0o644); err != nil {
		t.Fatal(err)
	}
	groups := []struct {
		name  string
		node  func(*testing.T) string
		cases []streamCase
	}{
		{"sandboxes", func(t *testing.T) string { u, _ := mockNode(t); return u }, []streamCase{
			{args: []string{"start", "-d"}, stdout: `^[0-9a-z]+\n$`},
			{args: []string{"ls"}, stdout: `(?s)^\[\n.*"sandboxID": "{id}".*\]\n$`},
			{args: []string{"ls", "-o", "table"}, stdout: `(?s)^ID .*{id}`},
			{args: []string{"info", "{id}"}, stdout: `(?s)^\{\n.*"sandboxID": "{id}"`},
			{args: []string{"timeout", "{id}", "90s"}, stdout: `^$`},
			{args: []string{"pause", "{id}"}, stdout: `^paused {id}\n$`},
			{args: []string{"resume", "{id}"}, stdout: `^resumed {id}\n$`},
			{args: []string{"kill", "{id}"}, stdout: `^killed {id}\n$`},
			{args: []string{"keys", "create", "ci"}, stdout: `^e2b_[0-9a-f]{40}\n$`},
			{args: []string{"keys", "list"}, stdout: `(?s)^\[\n.*"ci"`},
			{args: []string{"keys", "revoke", "ci"}, stdout: `^revoked ci`},
			{args: []string{"login", "--url", "{url}", "--api-key", "{key}"}, stdout: `^logged in to {url}; credentials saved in .*credentials.toml\n$`},
		}},
		{"snapshots", func(t *testing.T) string { u, _ := snapshotNode(t); return u }, []streamCase{
			{args: []string{"start", "-d"}, stdout: `^[0-9a-z]+\n$`},
			{args: []string{"snapshot", "create", "{id}", "--name", "s1"}, stdout: `(?s)^\{\n.*"s1"`},
			{args: []string{"snapshot", "ls"}, stdout: `(?s)^\[\n.*"s1"`},
			{args: []string{"fork", "{id}", "-n", "2"}, stdout: `^(\{"sandbox":\{[^\n]*\}\}\n){2}$`},
			{args: []string{"snapshot", "rm", "s1"}, stdout: `^deleted snapshot [0-9a-z]+\n$`},
		}},
		{"templates", func(t *testing.T) string { u, _ := pullNode(t); return u }, []streamCase{
			{args: []string{"pull", "oci:{layout}", "--name", "hello"}, stdout: `^[0-9a-z]+\thello\n$`, stderr: `(?s)download layer 1/1.*pulled oci:`},
			{args: []string{"pull", "-d", "oci:{layout}", "--name", "bg"}, stdout: `^[0-9a-z]+\tbg\n$`, stderr: "(?s)template bg .*follow with `aenv template logs -f"},
			{args: []string{"template", "ls"}, stdout: `(?s)^\[\n.*"hello"`},
			{args: []string{"template", "rm", "hello"}, stdout: `^[0-9a-z]+\n$`},
		}},
		{"local", nil, []streamCase{
			{args: []string{"layer", "create", "{dir}/rw", "--size", "1048576"}, stdout: `^[0-9A-Fa-f-]{36}\n$`},
			{args: []string{"layer", "import", raw, "{dir}/ro"}, stdout: `^sha256:[0-9a-f]{64} \d+\n$`},
			{args: []string{"layer", "inspect", "{dir}/ro", "-o", "json"}, stdout: `(?s)^\{.*\}\n$`},
			{args: []string{"template", "build-base", "--minimal", "--out", "{dir}/base"}, stdout: `^base rootfs ready in {dir}/base\n$`},
		}},
	}
	for _, g := range groups {
		t.Run(g.name, func(t *testing.T) {
			url := "http://127.0.0.1:1"
			if g.node != nil {
				url = g.node(t)
			}
			id := ""
			for _, c := range g.cases {
				r := strings.NewReplacer("{id}", id, "{url}", url, "{key}", testKey, "{dir}", dir, "{layout}", layout)
				args := make([]string, len(c.args))
				for i, a := range c.args {
					args[i] = r.Replace(a)
				}
				if args[0] == "template" && args[1] == "build-base" {
					if _, err := os.Stat("/bin/bash-static"); err != nil {
						continue // Debian's bash-static: scripts/deps.sh installs it
					}
				}
				stdout, stderr, err := aenv(t, url, args...)
				if err != nil {
					t.Errorf("aenv %s: %v\n%s", strings.Join(args, " "), err, stderr)
					continue
				}
				if args[0] == "start" {
					id = strings.TrimSpace(stdout)
				}
				re := func(s string) *regexp.Regexp { return regexp.MustCompile(r.Replace(s)) }
				if !re(c.stdout).MatchString(stdout) {
					t.Errorf("aenv %s: stdout %q, want %s", strings.Join(args, " "), stdout, r.Replace(c.stdout))
				}
				if c.stderr == "" && stderr != "" || c.stderr != "" && !re(c.stderr).MatchString(stderr) {
					t.Errorf("aenv %s: stderr %q, want %q", strings.Join(args, " "), stderr, r.Replace(c.stderr))
				}
			}
		})
	}
}

// upload and download say where the files went on stdout; "-" writes only the file there.
func TestFileCopyStreams(t *testing.T) {
	e := realEnvd(t)
	src := t.TempDir()
	os.WriteFile(filepath.Join(src, "f"), []byte("data"), 0o644)
	remote := filepath.Join(t.TempDir(), "up")
	for _, tc := range []struct {
		name   string
		run    func(cmd *cobra.Command) error
		stdout string
	}{
		{"upload file", func(cmd *cobra.Command) error { return e.upload(cmd, filepath.Join(src, "f"), remote+"-f", "") }, `^uploaded .*/f to sbx:.*up-f\n$`},
		{"upload dir", func(cmd *cobra.Command) error { return e.upload(cmd, src, remote, "") }, `^uploaded 1 files and 0 symlinks from .* to sbx:.*up\n$`},
		{"download file", func(cmd *cobra.Command) error {
			return e.download(cmd, remote+"-f", filepath.Join(t.TempDir(), "g"), "", 0o644, false, true)
		}, `^downloaded sbx:.*up-f to .*/g\n$`},
		{"download to stdout", func(cmd *cobra.Command) error { return e.download(cmd, remote+"-f", "-", "", 0o644, false, true) }, `^data$`},
	} {
		t.Run(tc.name, func(t *testing.T) {
			cmd := &cobra.Command{}
			cmd.SetContext(context.Background())
			var out, errb bytes.Buffer
			cmd.SetOut(&out)
			cmd.SetErr(&errb)
			if err := tc.run(cmd); err != nil {
				t.Fatalf("%v (%s)", err, errb.String())
			}
			if !regexp.MustCompile(tc.stdout).MatchString(out.String()) || errb.Len() != 0 {
				t.Errorf("stdout %q (want %s), stderr %q (want none)", out.String(), tc.stdout, errb.String())
			}
		})
	}
}
