package main

import (
	"bytes"
	"context"
	"encoding/json"
	"maps"
	"net"
	"net/http"
	"net/http/httptest"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/aenv-dev/aenv/internal/apikey"
	"github.com/aenv-dev/aenv/internal/catalog"
	"github.com/aenv-dev/aenv/internal/orchestrator"
	"github.com/aenv-dev/aenv/internal/sandbox"
	"github.com/aenv-dev/aenv/internal/sandbox/mock"
	"github.com/aenv-dev/aenv/internal/server"
	"github.com/aenv-dev/aenv/internal/server/api"
)

const testKey = "e2b_0123456789abcdef0123456789abcdef01234567"

func TestShellQuote(t *testing.T) {
	tests := []struct {
		args []string
		want string
	}{
		{[]string{"ls -la | wc -l"}, "ls -la | wc -l"},
		{[]string{"echo", "a b", "it's", "$HOME", "plain-arg_1.txt"}, `echo 'a b' 'it'\''s' '$HOME' plain-arg_1.txt`},
		{[]string{"printf", ""}, "printf ''"},
	}
	for _, tt := range tests {
		if got := shellQuote(tt.args); got != tt.want {
			t.Errorf("shellQuote(%q) = %s, want %s", tt.args, got, tt.want)
		}
	}
	// The quoting must survive a real shell.
	if _, err := exec.LookPath("sh"); err == nil {
		out, err := exec.Command("sh", "-c", shellQuote([]string{"printf", "%s|", "a b", "it's", "$HOME"})).Output()
		if err != nil || string(out) != "a b|it's|$HOME|" {
			t.Fatalf("sh ran %q: %q %v", shellQuote([]string{"printf", "%s|", "a b", "it's", "$HOME"}), out, err)
		}
	}
}

func TestParseKV(t *testing.T) {
	got, err := parseKV("--env", []string{"A=1", "B=x=y", "C="})
	if err != nil || !maps.Equal(got, map[string]string{"A": "1", "B": "x=y", "C": ""}) {
		t.Fatalf("parseKV = %v, %v", got, err)
	}
	for _, bad := range []string{"noequals", "=v"} {
		if _, err := parseKV("--env", []string{bad}); err == nil || !strings.Contains(err.Error(), "KEY=VALUE") {
			t.Errorf("parseKV(%q) err = %v", bad, err)
		}
	}
}

// mockNode runs the real server, orchestrator and catalog over the mock backend.
func mockNode(t *testing.T) (string, *catalog.Catalog) {
	t.Helper()
	return mockNodeWith(t, mock.New(mock.Options{}), nil)
}

// mockNodeWith runs the real server, orchestrator and catalog (with a "base" template and
// the test's API key) over be, the server's handler wrapped by wrap when it is not nil.
func mockNodeWith(t *testing.T, be *mock.Backend, wrap func(http.Handler) http.Handler) (string, *catalog.Catalog) {
	t.Helper()
	cat, err := catalog.Open(filepath.Join(t.TempDir(), "aenv.db"))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { cat.Close() })
	if err := cat.Templates().Put(catalog.Template{ID: "base", Kind: catalog.KindTemplate, RootFSDir: t.TempDir(),
		Resources: sandbox.Resources{CPUCount: 1, MemoryMB: 256}}); err != nil {
		t.Fatal(err)
	}
	if _, err := cat.APIKeys().Add("test", testKey); err != nil {
		t.Fatal(err)
	}
	reg := prometheus.NewRegistry()
	orch, err := orchestrator.New(orchestrator.Config{Registerer: reg}, be, cat)
	if err != nil {
		t.Fatal(err)
	}
	if err := orch.Start(context.Background()); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		orch.Shutdown(ctx)
	})
	srv, err := server.New(server.Options{Orchestrator: orch, Auth: apikey.NewVerifier(cat.APIKeys()), Keys: cat.APIKeys(), Registry: reg})
	if err != nil {
		t.Fatal(err)
	}
	var h http.Handler = srv
	if wrap != nil {
		h = wrap(srv)
	}
	hs := httptest.NewServer(h)
	t.Cleanup(hs.Close)
	return hs.URL, cat
}

// aenv runs the CLI in-process with the given args against url.
func aenv(t *testing.T, url string, args ...string) (string, string, error) {
	t.Helper()
	t.Setenv("AENV_URL", url)
	t.Setenv("AENV_API_KEY", testKey)
	t.Setenv("XDG_CONFIG_HOME", t.TempDir())
	root := newRootCmd()
	var out, errb bytes.Buffer
	root.SetOut(&out)
	root.SetErr(&errb)
	root.SetArgs(args)
	err := root.ExecuteContext(context.Background())
	return out.String(), errb.String(), err
}

func TestCLIAgainstNode(t *testing.T) {
	url, _ := mockNode(t)
	id, _, err := aenv(t, url, "start", "-d", "--metadata", "owner=a b", "--timeout", "10m", "--env", "X=1")
	if err != nil {
		t.Fatal(err)
	}
	id = strings.TrimSpace(id)
	if id == "" {
		t.Fatal("start -d printed no ID")
	}
	aenv(t, url, "start", "-d")

	// ls writes JSON when not on a terminal; the metadata filter uses the SDK encoding.
	out, _, err := aenv(t, url, "ls", "--metadata", "owner=a b")
	if err != nil {
		t.Fatal(err)
	}
	var listed []map[string]any
	if err := json.Unmarshal([]byte(out), &listed); err != nil {
		t.Fatalf("ls output is not JSON: %s", out)
	}
	if len(listed) != 1 || listed[0]["sandboxID"] != id {
		t.Fatalf("ls --metadata = %s", out)
	}
	out, _, _ = aenv(t, url, "ls", "-o", "table")
	if !strings.HasPrefix(out, "ID") || strings.Count(out, "\n") != 3 {
		t.Fatalf("table:\n%s", out)
	}
	if _, _, err := aenv(t, url, "ls", "-o", "yaml"); err == nil {
		t.Fatal("ls -o yaml accepted")
	}

	if _, _, err := aenv(t, url, "timeout", id, "90s"); err != nil {
		t.Fatal(err)
	}
	out, _, err = aenv(t, url, "info", id)
	if err != nil || !strings.Contains(out, `"state": "running"`) {
		t.Fatalf("info: %s %v", out, err)
	}
	if _, _, err := aenv(t, url, "pause", id); err != nil {
		t.Fatal(err)
	}
	_, _, err = aenv(t, url, "pause", id)
	if err == nil || !strings.Contains(err.Error(), "409") {
		t.Fatalf("second pause: %v", err)
	}
	_, _, err = aenv(t, url, "exec", id, "--", "true")
	if err == nil || !strings.Contains(err.Error(), "aenv resume") {
		t.Fatalf("exec on a paused sandbox: %v", err)
	}
	if stdout, _, err := aenv(t, url, "resume", id); err != nil || !strings.Contains(stdout, "resumed") {
		t.Fatalf("resume: %q %v", stdout, err)
	}
	if _, _, err := aenv(t, url, "kill", id); err != nil {
		t.Fatal(err)
	}
	_, _, err = aenv(t, url, "kill", id)
	if err == nil || !strings.Contains(err.Error(), "aenv ls") {
		t.Fatalf("kill of a gone sandbox: %v", err)
	}
	_, _, err = aenv(t, url, "start", "-d", "nope")
	if err == nil || !strings.Contains(err.Error(), "404") {
		t.Fatalf("start from an unknown template: %v", err)
	}
}

func TestCLIErrorsSayWhatToDo(t *testing.T) {
	url, _ := mockNode(t)
	t.Setenv("AENV_URL", url)
	root := newRootCmd()
	t.Setenv("XDG_CONFIG_HOME", t.TempDir())
	t.Setenv("AENV_API_KEY", "e2b_0000000000000000000000000000000000000000")
	root.SetArgs([]string{"ls"})
	root.SetOut(&bytes.Buffer{})
	err := root.Execute()
	if err == nil || !strings.Contains(err.Error(), "AENV_API_KEY") {
		t.Fatalf("bad key: %v", err)
	}
	_, _, err = aenv(t, "http://127.0.0.1:1", "ls")
	if err == nil || !strings.Contains(err.Error(), "aenv serve") {
		t.Fatalf("unreachable node: %v", err)
	}
}

func TestKeysThroughAPIWhenCatalogIsBusy(t *testing.T) {
	url, cat := mockNode(t)
	// The node holds the catalog's lock, as a running `aenv serve` does.
	dataDir := filepath.Dir(cat.Path())
	out, _, err := aenv(t, url, "keys", "create", "ci", "--data-dir", dataDir)
	if err != nil {
		t.Fatal(err)
	}
	key := strings.TrimSpace(out)
	if !apikey.E2BCompatible(key) {
		t.Fatalf("created key %q", key)
	}
	out, _, err = aenv(t, url, "keys", "list", "--data-dir", dataDir)
	if err != nil || !strings.Contains(out, `"name": "ci"`) || strings.Contains(out, key) {
		t.Fatalf("keys list: %s %v", out, err)
	}
	if _, _, err := aenv(t, url, "keys", "revoke", "ci", "--data-dir", dataDir); err != nil {
		t.Fatal(err)
	}
}

func TestKeysOnStoppedNodeCatalog(t *testing.T) {
	dir := t.TempDir()
	cat, err := catalog.Open(filepath.Join(dir, catalogFile))
	if err != nil {
		t.Fatal(err)
	}
	if _, err := cat.APIKeys().Add("admin", testKey); err != nil {
		t.Fatal(err)
	}
	cat.Close()
	// No node is reachable: the commands must work on the catalog directly.
	out, _, err := aenv(t, "http://127.0.0.1:1", "keys", "create", "ops", "--data-dir", dir)
	if err != nil || !apikey.E2BCompatible(strings.TrimSpace(out)) {
		t.Fatalf("keys create: %q %v", out, err)
	}
	if _, _, err := aenv(t, "http://127.0.0.1:1", "keys", "revoke", "ops", "--data-dir", dir); err != nil {
		t.Fatal(err)
	}
	_, _, err = aenv(t, "http://127.0.0.1:1", "keys", "revoke", "admin", "--data-dir", dir)
	if err == nil || !strings.Contains(err.Error(), "last API key") {
		t.Fatalf("revoking the last key: %v", err)
	}
}

func TestKeyFallsBackToAdminKeyFile(t *testing.T) {
	dir := t.TempDir()
	if err := apikey.WriteKeyFile(filepath.Join(dir, apikey.AdminKeyFile), testKey); err != nil {
		t.Fatal(err)
	}
	t.Setenv("XDG_CONFIG_HOME", t.TempDir())
	t.Setenv("AENV_API_KEY", "")
	t.Setenv("AENV_URL", "")
	g := &globals{dataDir: dir}
	u, key, err := g.resolve()
	if err != nil || key != testKey || u != defaultURL {
		t.Fatalf("resolve = %q %q %v", u, key, err)
	}
	g = &globals{dataDir: t.TempDir()}
	t.Setenv("AENV_DATA_DIR", t.TempDir())
	if _, _, err := g.resolve(); err == nil || !strings.Contains(err.Error(), "aenv login") {
		t.Fatalf("no key anywhere: %v", err)
	}
	g = &globals{url: "ftp://x", apiKey: testKey}
	if _, _, err := g.resolve(); err == nil || !strings.Contains(err.Error(), "http(s)") {
		t.Fatalf("bad URL: %v", err)
	}
}

func TestLoginWritesPrivateCredentials(t *testing.T) {
	url, _ := mockNode(t)
	cfgHome := t.TempDir()
	t.Setenv("XDG_CONFIG_HOME", cfgHome)
	t.Setenv("AENV_URL", "")
	t.Setenv("AENV_API_KEY", "")
	root := newRootCmd()
	root.SetArgs([]string{"login", "--url", url, "--api-key", testKey})
	root.SetErr(&bytes.Buffer{})
	if err := root.Execute(); err != nil {
		t.Fatal(err)
	}
	p := filepath.Join(cfgHome, "aenv", "credentials.toml")
	st, err := os.Stat(p)
	if err != nil || st.Mode().Perm() != 0o600 {
		t.Fatalf("credentials file: %v %v", st, err)
	}
	// Later commands use the saved URL and key.
	g := &globals{}
	u, key, err := g.resolve()
	if err != nil || u != url || key != testKey {
		t.Fatalf("resolve after login = %q %q %v", u, key, err)
	}
	// A wrong key is not saved.
	root = newRootCmd()
	root.SetArgs([]string{"login", "--url", url, "--api-key", "e2b_0000000000000000000000000000000000000000"})
	root.SetErr(&bytes.Buffer{})
	if err := root.Execute(); err == nil {
		t.Fatal("login with a wrong key succeeded")
	}
}

// A node that accepts connections and never answers does not hang the CLI: every command
// has a response timeout.
func TestCLIResponseTimeout(t *testing.T) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	go func() {
		var conns []net.Conn
		defer func() {
			for _, c := range conns {
				c.Close()
			}
		}()
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			conns = append(conns, c) // read nothing, answer nothing
		}
	}()
	for _, args := range [][]string{{"ls"}, {"info", "sbx1"}, {"template", "ls"}, {"kill", "sbx1"}} {
		_, _, err := aenv(t, "http://"+ln.Addr().String(), append([]string{"--response-timeout", "300ms"}, args...)...)
		if err == nil || !strings.Contains(err.Error(), "did not answer in time") {
			t.Fatalf("aenv %v against a silent node: %v", args, err)
		}
	}
}

// A 404's hint names the listing of the kind of thing that was not found.
func TestNotFoundHintNamesTheListing(t *testing.T) {
	url, _ := mockNode(t)
	for _, tc := range []struct {
		args []string
		hint string
	}{
		{[]string{"template", "rm", "nope"}, "aenv template ls"},
		{[]string{"info", "nope"}, "aenv ls"},
		{[]string{"keys", "revoke", "nope"}, "aenv keys list"},
	} {
		_, _, err := aenv(t, url, tc.args...)
		if err == nil || !strings.Contains(err.Error(), tc.hint) {
			t.Errorf("aenv %v: %v; want a hint naming %q", tc.args, err, tc.hint)
		}
	}
}

func TestUserTemplatesHidesImageImports(t *testing.T) {
	in := []api.Template{
		{TemplateID: "img-0123abcd"},
		{TemplateID: "img-4567", Aliases: []string{"python"}},
		{TemplateID: "t1", Aliases: []string{"my-app"}},
		{TemplateID: "base"},
	}
	var got []string
	for _, tpl := range userTemplates(in) {
		got = append(got, tpl.TemplateID)
	}
	if want := []string{"img-4567", "t1", "base"}; !slices.Equal(got, want) {
		t.Fatalf("listed %v, want %v", got, want)
	}
	if len(in) != 4 || in[0].TemplateID != "img-0123abcd" {
		t.Fatal("userTemplates changed its input")
	}
}

// TestIsTerminal: /dev/null (a script's stdin) and pipes are not terminals, a pty is.
func TestIsTerminal(t *testing.T) {
	null, err := os.Open(os.DevNull)
	if err != nil {
		t.Fatal(err)
	}
	defer null.Close()
	r, w, err := os.Pipe()
	if err != nil {
		t.Fatal(err)
	}
	defer r.Close()
	defer w.Close()
	for name, f := range map[string]*os.File{"/dev/null": null, "pipe": r} {
		if isTerminal(f) {
			t.Errorf("%s is taken for a terminal", name)
		}
	}
	ptmx, err := os.OpenFile("/dev/ptmx", os.O_RDWR, 0)
	if err != nil {
		t.Skipf("no pty to check the positive case: %v", err)
	}
	defer ptmx.Close()
	if !isTerminal(ptmx) {
		t.Error("a pty is not taken for a terminal")
	}
}
