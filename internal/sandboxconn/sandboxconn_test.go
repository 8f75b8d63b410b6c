package sandboxconn

import (
	"context"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
)

func TestPoolNames(t *testing.T) {
	tests := []struct {
		name, hostPort, id string
		ok                 bool
	}{
		{"ipv4", "10.88.0.7:49983", "sbx1", true},
		{"ipv6", "[fd00::7]:49983", "sbx1", true},
		{"hostname", "example.com:80", "sbx1", false},
		{"no port", "10.88.0.7", "sbx1", false},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			name, ok := poolName(tt.hostPort, tt.id)
			if ok != tt.ok {
				t.Fatalf("poolName(%q) ok = %v, want %v", tt.hostPort, ok, tt.ok)
			}
			if !ok {
				return
			}
			if !strings.Contains(name, poolSuffix) {
				t.Errorf("pool name %q lacks %q", name, poolSuffix)
			}
			if got := poolAddr(name); got != tt.hostPort {
				t.Errorf("poolAddr(%q) = %q, want %q", name, got, tt.hostPort)
			}
			if other, _ := poolName(tt.hostPort, tt.id+"x"); other == name {
				t.Errorf("two sandboxes on %s share the pool name %q", tt.hostPort, name)
			}
		})
	}
	for _, addr := range []string{"10.88.0.7:49983", "example.com:80", "zz-00.sandbox.invalid:1", "garbage"} {
		if got := poolAddr(addr); got != addr {
			t.Errorf("poolAddr(%q) = %q, want it unchanged", addr, got)
		}
	}
}

// One Pools serves two clients, as it serves the orchestrator's envd client and the
// proxy: a connection the first opened for a sandbox (the create's /init) carries the
// second's next request for that sandbox, and never another sandbox's on the same address.
func TestPoolsShareConnectionsPerSandbox(t *testing.T) {
	peers := make(chan string, 16)
	up := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		peers <- r.RemoteAddr
		io.Copy(io.Discard, r.Body)
		w.WriteHeader(http.StatusNoContent)
	}))
	t.Cleanup(up.Close)
	pools := New()
	t.Cleanup(pools.CloseIdleConnections)
	orch := &http.Client{Transport: pools}
	proxy := &http.Client{Transport: pools}

	via := func(c *http.Client, id string) string {
		t.Helper()
		ctx := context.Background()
		if id != "" {
			ctx = WithSandbox(ctx, id)
		}
		req, err := http.NewRequestWithContext(ctx, http.MethodPost, up.URL+"/init", strings.NewReader("{}"))
		if err != nil {
			t.Fatal(err)
		}
		resp, err := c.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		io.Copy(io.Discard, resp.Body)
		resp.Body.Close()
		if resp.StatusCode != http.StatusNoContent {
			t.Fatalf("status %d", resp.StatusCode)
		}
		return <-peers
	}
	initConn := via(orch, "a")
	if first := via(proxy, "a"); first != initConn {
		t.Errorf("sandbox a's first proxied request came over %s, not over its /init connection %s", first, initConn)
	}
	if b := via(proxy, "b"); b == initConn {
		t.Errorf("sandbox b got sandbox a's connection %s", b)
	}
	if plain := via(proxy, ""); plain == initConn {
		t.Errorf("an unmarked request got sandbox a's connection %s", plain)
	}
}
