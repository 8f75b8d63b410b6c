package main

import (
	"encoding/json"
	"io"
	"log/slog"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/aenv-dev/aenv/internal/server/api"
)

// apiCall sends one API request to the node as the test key.
func apiCall(t *testing.T, url, method, path, body string) *http.Response {
	t.Helper()
	req, err := http.NewRequest(method, url+path, strings.NewReader(body))
	if err != nil {
		t.Fatal(err)
	}
	req.Header.Set("X-API-Key", testKey)
	req.Header.Set("Content-Type", "application/json")
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { resp.Body.Close() })
	return resp
}

// TestTemplateLogsAndRmOfUnbuiltTemplates: templates that exist only as build records —
// a build that failed, one requested and not started, one still pulling — are shown
// and removed by name and by ID.
func TestTemplateLogsAndRmOfUnbuiltTemplates(t *testing.T) {
	url, _ := pullNode(t)
	// A build that fails: the mock backend's sandbox has no envd to run the steps.
	if r := apiCall(t, url, "POST", "/v3/templates", `{"name":"broken"}`); r.StatusCode != http.StatusAccepted {
		t.Fatalf("request: %d", r.StatusCode)
	}
	out, _, err := aenv(t, url, "template", "ls", "-o", "json")
	if err != nil || !strings.Contains(out, `"broken"`) {
		t.Fatalf("ls: %s %v", out, err)
	}
	// Requested, not started: waiting, and found by name.
	out, _, err = aenv(t, url, "template", "logs", "broken")
	if err != nil || !strings.Contains(out, "requested") || !strings.Contains(out, "is waiting") {
		t.Fatalf("logs of a waiting template by name: %q %v", out, err)
	}
	// Removed by name.
	if out, _, err = aenv(t, url, "template", "rm", "broken"); err != nil || strings.TrimSpace(out) != "broken" {
		t.Fatalf("rm of a waiting template by name: %q %v", out, err)
	}
	if _, _, err = aenv(t, url, "template", "logs", "broken"); err == nil {
		t.Fatal("logs after rm worked")
	}

	// `aenv pull -d REF --name X` then `aenv template logs -f X`, as the docs say.
	ref := "oci:" + pullTestLayout(t)
	if _, msgs, err := aenv(t, url, "pull", "-d", ref, "--name", "bg"); err != nil {
		t.Fatalf("%v\n%s", err, msgs)
	}
	out, _, err = aenv(t, url, "template", "logs", "-f", "bg")
	if !strings.Contains(out, "pulling "+ref) {
		t.Fatalf("logs -f bg: %q %v", out, err)
	}
	// A failed build (the mock node's sandbox has no envd to build in) is inspected and
	// removed by ID.
	r := apiCall(t, url, "POST", "/v3/templates", `{"name":"fails"}`)
	var req api.TemplateRequestResponseV3
	if err := json.NewDecoder(r.Body).Decode(&req); err != nil {
		t.Fatal(err)
	}
	if r := apiCall(t, url, "POST", "/v2/templates/"+req.TemplateID+"/builds/"+req.BuildID, `{"fromTemplate":"base"}`); r.StatusCode != http.StatusAccepted {
		t.Fatalf("start: %d", r.StatusCode)
	}
	out, _, err = aenv(t, url, "template", "logs", "-f", "fails")
	if err == nil || !strings.Contains(err.Error(), "build "+req.BuildID+" failed") || !strings.Contains(out, "requested") {
		t.Fatalf("logs -f of a failing build by name: %q %v", out, err)
	}
	if _, _, err = aenv(t, url, "template", "logs", req.TemplateID); err == nil || !strings.Contains(err.Error(), "failed") {
		t.Fatalf("logs of a failed template by ID: %v", err)
	}
	if out, _, err = aenv(t, url, "template", "rm", req.TemplateID); err != nil || strings.TrimSpace(out) != req.TemplateID {
		t.Fatalf("rm of a failed template by ID: %q %v", out, err)
	}
	if r := apiCall(t, url, "GET", "/templates/fails", ""); r.StatusCode != http.StatusNotFound {
		t.Errorf("GET /templates/fails after rm: %d", r.StatusCode)
	}
}

// TestBuildChecksSourcesBeforeRegistering: `COPY nonexist.txt /x` fails in the CLI and
// leaves no template behind on the node.
func TestBuildChecksSourcesBeforeRegistering(t *testing.T) {
	url, _ := pullNode(t)
	dir := t.TempDir()
	os.WriteFile(filepath.Join(dir, "Dockerfile"), []byte("FROM base\nCOPY here.txt /a\nCOPY nonexist.txt /x\n"), 0o644)
	os.WriteFile(filepath.Join(dir, "here.txt"), []byte("x"), 0o644)
	_, _, err := aenv(t, url, "build", "--name", "nosrc", dir)
	if err == nil || !strings.Contains(err.Error(), "COPY nonexist.txt: no such file") {
		t.Fatalf("build: %v", err)
	}
	out, _, err := aenv(t, url, "template", "ls", "-o", "json")
	if err != nil || strings.Contains(out, "nosrc") {
		t.Fatalf("a template was registered: %s %v", out, err)
	}
	if r := apiCall(t, url, "GET", "/templates/nosrc", ""); r.StatusCode != http.StatusNotFound {
		t.Errorf("GET /templates/nosrc: %d", r.StatusCode)
	}
}

// TestServeMetricsListener: metrics_listen serves /metrics and nothing else.
func TestServeMetricsListener(t *testing.T) {
	h := http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) { w.Write([]byte("aenv_x 1\n")) })
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	addr := ln.Addr().String()
	ln.Close()
	stop, err := serveMetrics(addr, h, true, slog.New(slog.NewTextHandler(io.Discard, nil)))
	if err != nil {
		t.Fatal(err)
	}
	defer stop()
	for path, want := range map[string]int{"/metrics": 200, "/health": 404, "/sandboxes": 404} {
		resp, err := http.Get("http://" + addr + path)
		if err != nil {
			t.Fatal(err)
		}
		resp.Body.Close()
		if resp.StatusCode != want {
			t.Errorf("GET %s: %d, want %d", path, resp.StatusCode, want)
		}
	}
	if _, err := serveMetrics("nope", h, false, slog.Default()); err == nil || !strings.Contains(err.Error(), "metrics_listen") {
		t.Errorf("bad address: %v", err)
	}
}
