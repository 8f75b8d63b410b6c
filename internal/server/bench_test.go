package server

import (
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"

	"github.com/aenv-dev/aenv/internal/orchestrator"
	"github.com/aenv-dev/aenv/internal/sandbox"
)

// BenchmarkProxyUnary measures the node's overhead on one envd unary call (header routing,
// token check, reverse proxy) over real loopback connections.
func BenchmarkProxyUnary(b *testing.B) {
	up := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		io.Copy(io.Discard, r.Body)
		w.Header().Set("Content-Type", "application/json")
		io.WriteString(w, "{}")
	}))
	defer up.Close()
	f := newFakeOrch()
	f.add(&orchestrator.Sandbox{ID: "s", State: orchestrator.StateRunning, EnvdAccessToken: "tok"})
	f.endpoints["s"] = sandbox.Endpoint{Host: "127.0.0.1", EnvdPort: portOfURL(b, up.URL)}
	s, err := New(Options{Orchestrator: f, Auth: fakeAuth{key: testKey}})
	if err != nil {
		b.Fatal(err)
	}
	front := httptest.NewServer(s)
	defer front.Close()
	client := front.Client()
	b.ReportAllocs()
	b.ResetTimer()
	for b.Loop() {
		req, _ := http.NewRequest("POST", front.URL+"/process.Process/List", strings.NewReader("{}"))
		req.Header.Set("E2b-Sandbox-Id", "s")
		req.Header.Set("E2b-Sandbox-Port", "49983")
		req.Header.Set("X-Access-Token", "tok")
		req.Header.Set("Content-Type", "application/json")
		resp, err := client.Do(req)
		if err != nil {
			b.Fatal(err)
		}
		io.Copy(io.Discard, resp.Body)
		resp.Body.Close()
		if resp.StatusCode != 200 {
			b.Fatalf("status %d", resp.StatusCode)
		}
	}
}

// BenchmarkCreateHandler measures the API edge of a create (decode, validate, encode) with
// the orchestrator faked out.
func BenchmarkCreateHandler(b *testing.B) {
	f := newFakeOrch()
	s, err := New(Options{Orchestrator: f, Auth: fakeAuth{key: testKey}})
	if err != nil {
		b.Fatal(err)
	}
	body := `{"templateID":"base","metadata":{"user":"a b"},"envVars":{"FOO":"bar"},"timeout":120}`
	b.ReportAllocs()
	for b.Loop() {
		req := httptest.NewRequest("POST", "/v2/sandboxes", strings.NewReader(body))
		req.Header.Set("X-API-Key", testKey)
		rec := httptest.NewRecorder()
		s.ServeHTTP(rec, req)
		if rec.Code != 201 {
			b.Fatalf("status %d", rec.Code)
		}
	}
}

func portOfURL(tb testing.TB, u string) int {
	tb.Helper()
	i := strings.LastIndexByte(u, ':')
	n := 0
	for _, c := range u[i+1:] {
		n = n*10 + int(c-'0')
	}
	return n
}
