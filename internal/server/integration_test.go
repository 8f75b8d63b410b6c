package server

import (
	"context"
	"encoding/json"
	"net/http"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/aenv-dev/aenv/internal/apikey"
	"github.com/aenv-dev/aenv/internal/catalog"
	"github.com/aenv-dev/aenv/internal/orchestrator"
	"github.com/aenv-dev/aenv/internal/sandbox"
	"github.com/aenv-dev/aenv/internal/sandbox/mock"
)

// realEnv wires the server to the real orchestrator, catalog and API keys over the mock
// backend (whose instances run a fake envd on loopback).
func realEnv(t *testing.T, o mock.Options) (*env, *mock.Backend) {
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
	be := mock.New(o)
	reg := prometheus.NewRegistry()
	orch, err := orchestrator.New(orchestrator.Config{Registerer: reg}, be, cat)
	if err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	if err := orch.Start(ctx); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		orch.Shutdown(ctx)
	})
	s, err := New(Options{Orchestrator: orch, Auth: apikey.NewVerifier(cat.APIKeys()), Registry: reg})
	if err != nil {
		t.Fatal(err)
	}
	return &env{t: t, srv: s, reg: reg}, be
}

// TestRealOrchestratorFlow walks the SDK flow of §5 of the protocol reference through the
// handler, the real orchestrator and the proxy.
func TestRealOrchestratorFlow(t *testing.T) {
	e, _ := realEnv(t, mock.Options{})
	rec := e.do("POST", "/v2/sandboxes", `{"templateID":"base","metadata":{"user":"a b"},"timeout":120}`)
	if rec.Code != 201 {
		t.Fatalf("create: %d %s", rec.Code, rec.Body)
	}
	var sb struct {
		SandboxID, EnvdAccessToken, EnvdVersion string
	}
	json.Unmarshal(rec.Body.Bytes(), &sb)
	if sb.SandboxID == "" || sb.EnvdAccessToken == "" || sb.EnvdVersion == "" {
		t.Fatalf("create body: %s", rec.Body)
	}
	id := sb.SandboxID

	// isRunning(): /health with sandbox headers reaches the (fake) envd.
	if rec := e.doWith("GET", "/health", "", envdHeaders(id, "")); rec.Code != http.StatusNoContent {
		t.Fatalf("envd health through the proxy: %d %s", rec.Code, rec.Body)
	}
	// Metadata filter as the JS SDK encodes it.
	got, _ := ids(t, e, "/v2/sandboxes?metadata=user%3Da%252520b&state=running,paused&limit=10")
	if strings.Join(got, " ") != id+":running" {
		t.Fatalf("list = %v", got)
	}
	for _, step := range []struct {
		method, path, body string
		status             int
	}{
		{"POST", "/sandboxes/" + id + "/timeout", `{"timeout":60}`, 204},
		{"GET", "/sandboxes/" + id, "", 200},
		{"GET", "/sandboxes/" + id + "/metrics", "", 200},
		{"POST", "/sandboxes/" + id + "/pause", `{}`, 204},
		{"POST", "/sandboxes/" + id + "/pause", `{}`, 409},
		{"GET", "/sandboxes/" + id, "", 200},
		{"POST", "/v2/sandboxes/" + id + "/connect", `{"timeout":90}`, 201},
		{"POST", "/v2/sandboxes/" + id + "/connect", `{"timeout":90}`, 200},
		{"POST", "/sandboxes/" + id + "/refreshes", `{"duration":10}`, 204},
		{"DELETE", "/sandboxes/" + id, "", 204},
		{"DELETE", "/sandboxes/" + id, "", 404},
		{"GET", "/sandboxes/" + id, "", 404},
		{"POST", "/v2/sandboxes/" + id + "/connect", `{}`, 404},
		{"POST", "/v2/sandboxes", `{"templateID":"does-not-exist"}`, 404},
	} {
		rec := e.do(step.method, step.path, step.body)
		if rec.Code != step.status {
			t.Fatalf("%s %s: %d %s, want %d", step.method, step.path, rec.Code, rec.Body, step.status)
		}
		if step.status >= 400 {
			wantError(t, rec, step.status, "")
		}
		if step.status == 201 && strings.HasSuffix(step.path, "/connect") {
			var again struct{ SandboxID, EnvdAccessToken string }
			json.Unmarshal(rec.Body.Bytes(), &again)
			if again.SandboxID != id || again.EnvdAccessToken != sb.EnvdAccessToken {
				t.Fatalf("resume changed id or token: %s", rec.Body)
			}
		}
	}
	// After kill: isRunning() is false because the proxy answers 502.
	wantGone(t, e.doWith("GET", "/health", "", envdHeaders(id, "")), id)
}

func TestRealOrchestratorPagingAndPausedProxy(t *testing.T) {
	e, _ := realEnv(t, mock.Options{})
	for range 5 {
		if rec := e.do("POST", "/v2/sandboxes", `{"templateID":"base"}`); rec.Code != 201 {
			t.Fatalf("create: %d %s", rec.Code, rec.Body)
		}
	}
	seen := map[string]bool{}
	path := "/v2/sandboxes?limit=2"
	for range 5 {
		got, next := ids(t, e, path)
		for _, s := range got {
			seen[s] = true
		}
		if next == "" {
			break
		}
		path = "/v2/sandboxes?limit=2&nextToken=" + next
	}
	if len(seen) != 5 {
		t.Fatalf("paging saw %d sandboxes: %v", len(seen), seen)
	}
	wantError(t, e.do("GET", "/v2/sandboxes?nextToken=garbage", ""), 400, "")

	// A paused sandbox without autoResume answers E2B's 409 on the proxy, never hangs.
	rec := e.do("POST", "/v2/sandboxes", `{"templateID":"base"}`)
	var sb struct{ SandboxID string }
	json.Unmarshal(rec.Body.Bytes(), &sb)
	if rec := e.do("POST", "/sandboxes/"+sb.SandboxID+"/pause", ""); rec.Code != 204 {
		t.Fatalf("pause: %d %s", rec.Code, rec.Body)
	}
	wantPaused(t, e.doWith("GET", "/health", "", envdHeaders(sb.SandboxID, "")), sb.SandboxID)

	// With autoResume the proxy resumes it transparently.
	rec = e.do("POST", "/v2/sandboxes", `{"templateID":"base","autoResume":{"enabled":true}}`)
	json.Unmarshal(rec.Body.Bytes(), &sb)
	e.do("POST", "/sandboxes/"+sb.SandboxID+"/pause", "")
	if rec := e.doWith("GET", "/health", "", envdHeaders(sb.SandboxID, "")); rec.Code != 204 {
		t.Fatalf("auto-resume through the proxy: %d %s", rec.Code, rec.Body)
	}
	var info struct{ State string }
	json.Unmarshal(e.do("GET", "/sandboxes/"+sb.SandboxID, "").Body.Bytes(), &info)
	if info.State != "running" {
		t.Fatalf("state after proxied request = %q", info.State)
	}
}

func TestRealAuthRejectsUnknownKey(t *testing.T) {
	e, _ := realEnv(t, mock.Options{})
	wantError(t, e.doWith("GET", "/v2/sandboxes", "", map[string]string{"X-API-Key": "e2b_0000000000000000000000000000000000000000"}), 401, "")
}

func TestAPIKeyManagement(t *testing.T) {
	cat, err := catalog.Open(filepath.Join(t.TempDir(), "aenv.db"))
	if err != nil {
		t.Fatal(err)
	}
	defer cat.Close()
	if _, err := cat.APIKeys().Add("admin", testKey); err != nil {
		t.Fatal(err)
	}
	s, err := New(Options{Orchestrator: newFakeOrch(), Auth: apikey.NewVerifier(cat.APIKeys()), Keys: cat.APIKeys()})
	if err != nil {
		t.Fatal(err)
	}
	e := &env{t: t, srv: s}
	wantError(t, e.do("DELETE", "/aenv/keys/admin", ""), 409, "last API key")
	rec := e.do("POST", "/aenv/keys", `{"name":"ci"}`)
	if rec.Code != 201 {
		t.Fatalf("create key: %d %s", rec.Code, rec.Body)
	}
	created := decode[map[string]any](t, rec)
	newKey, _ := created["key"].(string)
	if !apikey.E2BCompatible(newKey) {
		t.Fatalf("created key %q is not in the E2B format", newKey)
	}
	wantError(t, e.do("POST", "/aenv/keys", `{"name":""}`), 400, "name")
	// The new key works; listing never shows secrets.
	rec = e.doWith("GET", "/aenv/keys", "", map[string]string{"X-API-Key": newKey})
	if rec.Code != 200 || strings.Contains(rec.Body.String(), newKey) || strings.Contains(rec.Body.String(), testKey) {
		t.Fatalf("list keys: %d %s", rec.Code, rec.Body)
	}
	if n := len(decode[[]map[string]any](t, rec)); n != 2 {
		t.Fatalf("keys = %d, want 2", n)
	}
	if rec := e.do("DELETE", "/aenv/keys/ci", ""); rec.Code != 204 {
		t.Fatalf("revoke: %d %s", rec.Code, rec.Body)
	}
	wantError(t, e.doWith("GET", "/aenv/keys", "", map[string]string{"X-API-Key": newKey}), 401, "")
	wantError(t, e.do("DELETE", "/aenv/keys/nope", ""), 404, "")

	// Without a KeyManager the endpoints say so.
	e2 := newEnv(t)
	wantError(t, e2.do("GET", "/aenv/keys", ""), 404, "not enabled")
}
