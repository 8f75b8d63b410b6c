package main

import (
	"bytes"
	"context"
	"errors"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/aenv-dev/aenv/internal/envd"
	"github.com/aenv-dev/aenv/internal/envd/identity"
	"github.com/aenv-dev/aenv/internal/envd/state"
)

// realEnvd serves a real envd (running commands as root on this host) and returns a
// client of it, as `aenv exec` reaches envd through a node.
func realEnvd(t *testing.T) *envdClient {
	t.Helper()
	if os.Geteuid() != 0 {
		t.Skip("envd runs commands as a user: needs root")
	}
	dir := t.TempDir()
	pw, gr := filepath.Join(dir, "passwd"), filepath.Join(dir, "group")
	os.WriteFile(pw, []byte("root:x:0:0:root:"+dir+":/bin/sh\n"), 0o644)
	os.WriteFile(gr, []byte("root:x:0:\n"), 0o644)
	srv := envd.New(envd.Config{Users: identity.DB{PasswdPath: pw, GroupPath: gr}, Defaults: state.New("root"), DiskPath: dir})
	hs := httptest.NewServer(srv)
	t.Cleanup(func() {
		srv.Process.SignalAll(9)
		hs.Close()
	})
	c := &client{base: hs.URL, http: &http.Client{}}
	return c.envd("sbx", "")
}

// exec forwards stdin (closing it at EOF) and reports a command a signal ended as a shell
// does, 128+N.
func TestExecStdinAndSignalStatus(t *testing.T) {
	e := realEnvd(t)
	ctx := context.Background()
	for _, tc := range []struct {
		name, cmd string
		stdin     *string
		out       string
		code      int
	}{
		{"stdin forwarded", "cat; echo done", ptr("hello\nworld\n"), "hello\nworld\ndone\n", 0},
		{"large stdin", "wc -c", ptr(strings.Repeat("x", 300000)), "300000\n", 0},
		{"no stdin reads EOF", "cat; echo done", nil, "done\n", 0},
		{"exit code", "exit 3", nil, "", 3},
		{"SIGKILL", "kill -9 $$", nil, "", 137},
		{"SIGTERM", "kill -TERM $$", nil, "", 143},
	} {
		t.Run(tc.name, func(t *testing.T) {
			var in *strings.Reader
			var stdout, stderr bytes.Buffer
			var code int
			var err error
			if tc.stdin != nil {
				in = strings.NewReader(*tc.stdin)
				code, err = e.run(ctx, tc.cmd, nil, "", "", in, &stdout, &stderr)
			} else {
				code, err = e.run(ctx, tc.cmd, nil, "", "", nil, &stdout, &stderr)
			}
			if err != nil || code != tc.code || strings.TrimLeft(stdout.String(), " ") != tc.out {
				t.Fatalf("code %d (%v), stdout %q, stderr %q; want %d, %q", code, err, stdout.String(), stderr.String(), tc.code, tc.out)
			}
		})
	}
}

func ptr[T any](v T) *T { return &v }

// Without a terminal, `aenv connect` / `aenv start` run the shell on stdin's commands and
// end at its EOF (before, a script's `aenv start </dev/null` waited out the sandbox).
func TestShellWithoutTerminal(t *testing.T) {
	e := realEnvd(t)
	null, err := os.Open(os.DevNull)
	if err != nil {
		t.Fatal(err)
	}
	defer null.Close()
	var stdout, stderr bytes.Buffer
	if err := e.shell(context.Background(), null, &stdout, &stderr); err != nil || stdout.Len() != 0 {
		t.Fatalf("shell on /dev/null: %v, stdout %q, stderr %q", err, stdout.String(), stderr.String())
	}
	r, w, err := os.Pipe()
	if err != nil {
		t.Fatal(err)
	}
	defer r.Close()
	go func() {
		w.WriteString("echo hi; echo oops >&2\nexit 3\n")
		w.Close()
	}()
	stdout.Reset()
	stderr.Reset()
	err = e.shell(context.Background(), r, &stdout, &stderr)
	var code exitCodeError
	if !errors.As(err, &code) || code.code != 3 || stdout.String() != "hi\n" || stderr.String() != "oops\n" {
		t.Fatalf("shell on a pipe: %v, stdout %q, stderr %q", err, stdout.String(), stderr.String())
	}
}
