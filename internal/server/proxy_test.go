package server

import (
	"bufio"
	"bytes"
	"encoding/json"
	"fmt"
	"io"
	"log"
	"net"
	"net/http"
	"net/http/httptest"
	"net/url"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/aenv-dev/aenv/internal/orchestrator"
	"github.com/aenv-dev/aenv/internal/relay/relaytest"
	"github.com/aenv-dev/aenv/internal/sandbox"
	"github.com/aenv-dev/aenv/internal/sandboxconn"
)

// seen is what the upstream (standing in for envd or a user app) received.
type seen struct {
	Method, Path, RawPath, Query, Host string
	Header                             http.Header
}

func upstreamServer(t *testing.T) (*httptest.Server, chan seen) {
	t.Helper()
	ch := make(chan seen, 16)
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		ch <- seen{r.Method, r.URL.Path, r.URL.RawPath, r.URL.RawQuery, r.Host, r.Header.Clone()}
		w.Header().Set("X-Upstream", "yes")
		w.WriteHeader(http.StatusTeapot)
		io.WriteString(w, "from upstream")
	}))
	t.Cleanup(srv.Close)
	return srv, ch
}

func portOf(t *testing.T, srv *httptest.Server) int {
	u, _ := url.Parse(srv.URL)
	p, _ := strconv.Atoi(u.Port())
	return p
}

// proxyEnv has sandbox "sb1" (envd token "tok1") whose envd and user port 8080 are the
// upstream server, and sandbox "gone" that is known but unreachable.
func proxyEnv(t *testing.T, opts ...func(*Options)) (*env, chan seen, int) {
	e := newEnv(t, opts...)
	up, ch := upstreamServer(t)
	port := portOf(t, up)
	e.orch.add(&orchestrator.Sandbox{ID: "sb1", State: orchestrator.StateRunning, EnvdAccessToken: "tok1"})
	e.orch.endpoints["sb1"] = sandbox.Endpoint{Host: "127.0.0.1", EnvdPort: port}
	// A listener that is closed at once: connections to it are refused.
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	deadPort := l.Addr().(*net.TCPAddr).Port
	l.Close()
	e.orch.add(&orchestrator.Sandbox{ID: "gone", State: orchestrator.StateRunning})
	e.orch.endpoints["gone"] = sandbox.Endpoint{Host: "127.0.0.1", EnvdPort: deadPort}
	return e, ch, port
}

func envdHeaders(id, token string) map[string]string {
	h := map[string]string{"E2b-Sandbox-Id": id, "E2b-Sandbox-Port": "49983"}
	if token != "" {
		h["X-Access-Token"] = token
	}
	return h
}

func wantUpstream(t *testing.T, rec *httptest.ResponseRecorder, ch chan seen) seen {
	t.Helper()
	if rec.Code != http.StatusTeapot || rec.Body.String() != "from upstream" {
		t.Fatalf("not proxied: %d %s", rec.Code, rec.Body)
	}
	select {
	case s := <-ch:
		return s
	case <-time.After(5 * time.Second):
		t.Fatal("upstream saw nothing")
	}
	return seen{}
}

func TestProxyHeaderRouting(t *testing.T) {
	e, ch, _ := proxyEnv(t)
	// /health and /metrics exist on both sides: the header decides.
	rec := e.doWith("GET", "/health", "", envdHeaders("sb1", ""))
	s := wantUpstream(t, rec, ch)
	if s.Path != "/health" {
		t.Fatalf("path = %q", s.Path)
	}
	rec = e.doWith("POST", "/process.Process/Start?x=1", `{}`, map[string]string{
		"E2b-Sandbox-Id": "sb1", "E2b-Sandbox-Port": "49983", "X-Access-Token": "tok1",
		"X-API-Key": testKey, "Authorization": "Basic dXNlcjo=",
	})
	s = wantUpstream(t, rec, ch)
	if s.Path != "/process.Process/Start" || s.Query != "x=1" || s.Method != "POST" {
		t.Fatalf("upstream saw %+v", s)
	}
	if s.Header.Get("E2b-Sandbox-Id") != "" || s.Header.Get("X-API-Key") != "" {
		t.Fatalf("routing headers or the API key leaked upstream: %v", s.Header)
	}
	if s.Header.Get("X-Access-Token") != "tok1" || s.Header.Get("Authorization") != "Basic dXNlcjo=" {
		t.Fatalf("envd auth headers must pass through: %v", s.Header)
	}
	if rec.Header().Get("X-Upstream") != "yes" {
		t.Fatal("response headers not copied")
	}
	// /metrics with sandbox headers is the sandbox's, not the node's.
	rec = e.doWith("GET", "/metrics", "", envdHeaders("sb1", "tok1"))
	wantUpstream(t, rec, ch)
}

// AgentENV users set E2B_SANDBOX_URL=$URL/proxy: the SDK's requests carry the /proxy prefix
// and the routing headers, E2B's or AgentENV's names. The prefix is stripped, nothing of the
// routing reaches the sandbox, and the envd rules still apply after the strip.
func TestProxyAgentenvCompat(t *testing.T) {
	e, ch, port := proxyEnv(t)
	agentenv := func(id, port, token string) map[string]string {
		return map[string]string{"X-Agentenv-Sandbox-Id": id, "X-Agentenv-Target-Port": port, "X-Access-Token": token}
	}
	tests := []struct {
		name, method, path string
		hdr                map[string]string
		wantPath, wantRaw  string
	}{
		{"e2b headers, prefix", "POST", "/proxy/process.Process/Start", envdHeaders("sb1", "tok1"), "/process.Process/Start", ""},
		{"e2b headers, bare prefix", "GET", "/proxy", envdHeaders("sb1", "tok1"), "/", ""},
		{"agentenv headers, prefix", "GET", "/proxy/health", agentenv("sb1", "49983", ""), "/health", ""},
		{"agentenv headers, no prefix", "POST", "/filesystem.Filesystem/Stat", agentenv("sb1", "49983", "tok1"), "/filesystem.Filesystem/Stat", ""},
		{"agentenv headers, user port, escaped path", "GET", "/proxy/a/b%2Fc", agentenv("sb1", strconv.Itoa(port), ""), "/a/b/c", "/a/b%2Fc"},
		{"not a prefix", "GET", "/proxyfoo", agentenv("sb1", strconv.Itoa(port), ""), "/proxyfoo", ""},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			s := wantUpstream(t, e.doWith(tt.method, tt.path, "", tt.hdr), ch)
			if s.Path != tt.wantPath || s.RawPath != tt.wantRaw {
				t.Fatalf("upstream path = %q (raw %q), want %q (raw %q)", s.Path, s.RawPath, tt.wantPath, tt.wantRaw)
			}
			for _, h := range []string{"X-Agentenv-Sandbox-Id", "X-Agentenv-Target-Port", "E2b-Sandbox-Id", "E2b-Sandbox-Port"} {
				if s.Header.Get(h) != "" {
					t.Fatalf("routing header %s reached the sandbox", h)
				}
			}
		})
	}
	wantError(t, e.doWith("POST", "/proxy/init", "", envdHeaders("sb1", "tok1")), 403, "internal")
	wantError(t, e.doWith("POST", "/proxy/process.Process/List", "", agentenv("sb1", "49983", "")), 401, "X-Access-Token")
	wantError(t, e.doWith("GET", "/proxy/health", "", map[string]string{"X-Agentenv-Sandbox-Id": "sb1"}), 400, "X-Agentenv-Target-Port")
	wantError(t, e.doWith("GET", "/proxy/health", "", map[string]string{"X-Agentenv-Target-Port": "49983"}), 400, "X-Agentenv-Sandbox-Id")
	wantGone(t, e.doWith("GET", "/proxy/health", "", agentenv("nope", "49983", "")), "nope")
	select {
	case s := <-ch:
		t.Fatalf("rejected request reached upstream: %+v", s)
	default:
	}
}

func TestProxyEnvdAuth(t *testing.T) {
	e, ch, _ := proxyEnv(t)
	tests := []struct {
		name, method, path, token string
		status                    int
	}{
		{"rpc without token", "POST", "/process.Process/List", "", 401},
		{"rpc wrong token", "POST", "/filesystem.Filesystem/Stat", "tok2", 401},
		{"rpc right token", "POST", "/filesystem.Filesystem/Stat", "tok1", 418},
		{"health is exempt", "GET", "/health", "", 418},
		{"files GET is exempt (envd checks signatures)", "GET", "/files", "", 418},
		{"files POST is exempt", "POST", "/files", "", 418},
		{"envs needs the token", "GET", "/envs", "", 401},
		{"init is internal", "POST", "/init", "tok1", 403},
		{"freeze is internal", "POST", "/freeze", "tok1", 403},
		{"unclean internal path", "POST", "//init/", "tok1", 403},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			rec := e.doWith(tt.method, tt.path, "", envdHeaders("sb1", tt.token))
			if tt.status == 418 {
				wantUpstream(t, rec, ch)
				return
			}
			wantError(t, rec, tt.status, "")
			select {
			case s := <-ch:
				t.Fatalf("rejected request reached upstream: %+v", s)
			default:
			}
		})
	}
}

func TestProxyHeaderErrors(t *testing.T) {
	e, _, _ := proxyEnv(t)
	wantError(t, e.doWith("GET", "/health", "", map[string]string{"E2b-Sandbox-Id": "sb1"}), 400, "Missing header: E2b-Sandbox-Port")
	wantError(t, e.doWith("GET", "/health", "", map[string]string{"E2b-Sandbox-Port": "49983"}), 400, "Missing header: E2b-Sandbox-Id")
	wantError(t, e.doWith("GET", "/health", "", map[string]string{"E2b-Sandbox-Id": "sb1", "E2b-Sandbox-Port": "http"}), 400, "port")
}

func wantGone(t *testing.T, rec *httptest.ResponseRecorder, id string) {
	t.Helper()
	if rec.Code != http.StatusBadGateway {
		t.Fatalf("status = %d, want 502: %s", rec.Code, rec.Body)
	}
	var body map[string]any
	if err := json.Unmarshal(rec.Body.Bytes(), &body); err != nil {
		t.Fatalf("502 body is not JSON: %s", rec.Body)
	}
	if body["code"] != float64(502) || body["sandboxId"] != id || body["message"] == "" {
		t.Fatalf("502 body = %s", rec.Body)
	}
}

func TestProxyGoneSandbox(t *testing.T) {
	e, _, _ := proxyEnv(t)
	wantGone(t, e.doWith("GET", "/health", "", envdHeaders("nope", "")), "nope")
	wantGone(t, e.doWith("GET", "/health", "", envdHeaders("gone", "")), "gone")
	wantGone(t, e.doWith("GET", "/proxy/nope/8080/", "", nil), "nope")
}

// A paused sandbox without autoResume answers E2B's 409 on every routing mode, never a hang.
func TestProxyPausedSandbox(t *testing.T) {
	e, _, _ := proxyEnv(t, func(o *Options) { o.Domains = []string{"sb.test"} })
	e.orch.add(&orchestrator.Sandbox{ID: "zz", State: orchestrator.StatePaused, EnvdAccessToken: "t"})
	for name, rec := range map[string]*httptest.ResponseRecorder{
		"header": e.doWith("GET", "/health", "", envdHeaders("zz", "")),
		"path":   e.doWith("GET", "/proxy/zz/8080/x", "", nil),
		"host":   e.doWith("GET", "/x", "", map[string]string{"Host": "8080-zz.sb.test"}),
	} {
		t.Run(name, func(t *testing.T) { wantPaused(t, rec, "zz") })
	}
}

func wantPaused(t *testing.T, rec *httptest.ResponseRecorder, id string) {
	t.Helper()
	if rec.Code != http.StatusConflict {
		t.Fatalf("status = %d, want 409: %s", rec.Code, rec.Body)
	}
	var body map[string]any
	if err := json.Unmarshal(rec.Body.Bytes(), &body); err != nil {
		t.Fatalf("body is not JSON: %s", rec.Body)
	}
	want := map[string]any{"sandboxId": id, "message": "The sandbox is paused", "code": float64(409), "canAutoResume": false}
	if fmt.Sprint(body) != fmt.Sprint(want) {
		t.Fatalf("body = %v, want %v", body, want)
	}
}

func TestProxyAutoResume(t *testing.T) {
	e, ch, _ := proxyEnv(t)
	e.orch.sandboxes["sb1"].State = orchestrator.StatePaused
	e.orch.sandboxes["sb1"].AutoResume = true
	wantUpstream(t, e.doWith("GET", "/health", "", envdHeaders("sb1", "")), ch)
	if e.orch.sandboxes["sb1"].State != orchestrator.StateRunning {
		t.Fatal("sandbox was not resumed")
	}
}

func TestProxyPathRouting(t *testing.T) {
	e, ch, port := proxyEnv(t)
	p := strconv.Itoa(port)
	rec := e.doWith("GET", "/proxy/sb1/"+p+"/a/b%2Fc?q=1", "", map[string]string{"X-API-Key": testKey})
	s := wantUpstream(t, rec, ch)
	if s.Path != "/a/b/c" || s.RawPath != "/a/b%2Fc" || s.Query != "q=1" {
		t.Fatalf("upstream saw %+v", s)
	}
	if s.Header.Get("X-API-Key") != "" || s.Header.Get("X-Access-Token") != "" {
		t.Fatal("API key or envd token reached a user port")
	}
	rec = e.doWith("GET", "/proxy/sb1/"+p, "", nil)
	if s := wantUpstream(t, rec, ch); s.Path != "/" {
		t.Fatalf("bare proxy path went to %q", s.Path)
	}
	// The envd port through /proxy still needs the token.
	wantError(t, e.doWith("POST", "/proxy/sb1/49983/process.Process/List", "", nil), 401, "X-Access-Token")
	wantError(t, e.doWith("GET", "/proxy/sb1", "", nil), 400, "/proxy/{sandboxID}/{port}")
	wantError(t, e.doWith("GET", "/proxy/sb1/99999/", "", nil), 400, "port")
}

func TestProxyUserPortsArePublic(t *testing.T) {
	e, ch, port := proxyEnv(t)
	e.orch.sandboxes["sb1"].TrafficAccessToken = "traffic"
	path := "/proxy/sb1/" + strconv.Itoa(port) + "/"
	s := wantUpstream(t, e.doWith("GET", path, "", map[string]string{"E2b-Traffic-Access-Token": "traffic"}), ch)
	if s.Header.Get("E2b-Traffic-Access-Token") != "" {
		t.Fatal("traffic token forwarded to the app")
	}
	wantUpstream(t, e.doWith("GET", path, "", nil), ch)
}

// maskRequestHost replaces the Host a user port sees (${PORT} is the port); envd keeps
// the address.
func TestProxyMaskRequestHost(t *testing.T) {
	e, ch, port := proxyEnv(t)
	e.orch.sandboxes["sb1"].MaskRequestHost = "${PORT}-app.example.com"
	s := wantUpstream(t, e.doWith("GET", "/proxy/sb1/"+strconv.Itoa(port)+"/", "", nil), ch)
	if want := strconv.Itoa(port) + "-app.example.com"; s.Host != want {
		t.Fatalf("user port saw Host %q, want %q", s.Host, want)
	}
	s = wantUpstream(t, e.doWith("GET", "/health", "", envdHeaders("sb1", "tok1")), ch)
	if s.Host != "127.0.0.1:"+strconv.Itoa(port) {
		t.Fatalf("envd saw Host %q", s.Host)
	}
}

func TestProxyPrivateSandboxNeedsTrafficToken(t *testing.T) {
	e, ch, port := proxyEnv(t)
	e.orch.sandboxes["sb1"].TrafficAccessToken = "traffic"
	e.orch.sandboxes["sb1"].Private = true
	path := "/proxy/sb1/" + strconv.Itoa(port) + "/"
	wantError(t, e.doWith("GET", path, "", nil), 403, "E2b-Traffic-Access-Token")
	wantError(t, e.doWith("GET", path, "", map[string]string{"E2b-Traffic-Access-Token": "wrong"}), 403, "private sandbox")
	s := wantUpstream(t, e.doWith("GET", path, "", map[string]string{"E2b-Traffic-Access-Token": "traffic"}), ch)
	if s.Header.Get("E2b-Traffic-Access-Token") != "" {
		t.Fatal("traffic token forwarded to the app")
	}
}

func TestProxyHostRouting(t *testing.T) {
	e, ch, port := proxyEnv(t, func(o *Options) { o.Domains = []string{"sbx.test", "localhost:8000"} })
	tests := []struct {
		host    string
		proxied bool
	}{
		{strconv.Itoa(port) + "-sb1.sbx.test", true},
		{strconv.Itoa(port) + "-sb1.sbx.test:443", true},
		{strconv.Itoa(port) + "-sb1.localhost:8000", true},
		{"api.sbx.test", false},
		{"sbx.test", false},
		{"x-sb1.sbx.test", false},
		{strconv.Itoa(port) + "-sb1.other.test", false},
	}
	for _, tt := range tests {
		t.Run(tt.host, func(t *testing.T) {
			req := httptest.NewRequest("GET", "/some/page", nil)
			req.Host = tt.host
			rec := httptest.NewRecorder()
			e.srv.ServeHTTP(rec, req)
			if !tt.proxied {
				wantError(t, rec, 404, "route not found")
				return
			}
			if s := wantUpstream(t, rec, ch); s.Path != "/some/page" {
				t.Fatalf("path = %q", s.Path)
			}
		})
	}
	// Hyphenated IDs: split at the first '-' only.
	e.orch.add(&orchestrator.Sandbox{ID: "a-b-c", State: orchestrator.StateRunning})
	e.orch.endpoints["a-b-c"] = sandbox.Endpoint{Host: "127.0.0.1", EnvdPort: port}
	req := httptest.NewRequest("GET", "/", nil)
	req.Host = strconv.Itoa(port) + "-a-b-c.sbx.test"
	rec := httptest.NewRecorder()
	e.srv.ServeHTTP(rec, req)
	wantUpstream(t, rec, ch)
}

func TestFileSignatureVectors(t *testing.T) {
	// Test vectors from the protocol reference (§2.5).
	if got := FileSignature("/home/user/hello.txt", "read", "", "envd-token-xyz", 0); got != "v1_uJVyV4+iuu8jC1Pc5vfC3iV6nFJtAmDNwSzE7IuT5x0" {
		t.Fatalf("read signature = %s", got)
	}
	if got := FileSignature("/home/user/hello.txt", "write", "user", "envd-token-xyz", 1700000000); got != "v1_DMBXHZcHMC8VksbQVFN9lNv5L/cGErLXpAOJokN3X3M" {
		t.Fatalf("write signature = %s", got)
	}
}

func TestProxySignedURL(t *testing.T) {
	e, ch, port := proxyEnv(t)
	// A second sandbox, so routing has to pick by signature.
	e.orch.add(&orchestrator.Sandbox{ID: "sb2", State: orchestrator.StateRunning, EnvdAccessToken: "tok2"})
	e.orch.endpoints["sb2"] = sandbox.Endpoint{Host: "127.0.0.1", EnvdPort: port}
	future := time.Now().Add(time.Hour).Unix()
	past := time.Now().Add(-time.Hour).Unix()
	signed := func(tok, op, user string, exp int64) string {
		q := url.Values{"path": {"/home/user/x.txt"}, "signature": {FileSignature("/home/user/x.txt", op, user, tok, exp)}}
		if user != "" {
			q.Set("username", user)
		}
		if exp != 0 {
			q.Set("signature_expiration", strconv.FormatInt(exp, 10))
		}
		return "/files?" + q.Encode()
	}
	tests := []struct {
		name, method, url string
		status            int
		msg               string
	}{
		{"download", "GET", signed("tok2", "read", "", 0), 418, ""},
		{"upload with user and expiry", "POST", signed("tok1", "write", "root", future), 418, ""},
		{"operation mismatch", "POST", signed("tok1", "read", "", 0), 401, "does not match"},
		{"unknown token", "GET", signed("tok3", "read", "", 0), 401, "does not match"},
		{"expired", "GET", signed("tok1", "read", "", past), 401, "signature is already expired"},
		{"bad expiration", "GET", "/files?path=x&signature=v1_x&signature_expiration=soon", 400, "unix seconds"},
		{"wrong method", "DELETE", signed("tok1", "read", "", 0), 405, "GET and POST"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			rec := e.doWith(tt.method, tt.url, "", nil)
			if tt.status != 418 {
				wantError(t, rec, tt.status, tt.msg)
				return
			}
			s := wantUpstream(t, rec, ch)
			if s.Path != "/files" || !strings.Contains(s.Query, "signature=") {
				t.Fatalf("upstream saw %+v", s)
			}
		})
	}
}

// TestProxyStreamsUnbuffered: the client must see each chunk while the upstream is still
// producing the response (Connect server streams, background commands).
func TestProxyStreamsUnbuffered(t *testing.T) {
	e := newEnv(t)
	release := make(chan struct{})
	up := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "application/connect+json")
		w.WriteHeader(200)
		io.WriteString(w, "first-envelope\n")
		w.(http.Flusher).Flush()
		<-release
		io.WriteString(w, "second-envelope\n")
	}))
	defer up.Close()
	defer close(release)
	e.orch.add(&orchestrator.Sandbox{ID: "s", State: orchestrator.StateRunning})
	e.orch.endpoints["s"] = sandbox.Endpoint{Host: "127.0.0.1", EnvdPort: portOf(t, up)}
	front := httptest.NewServer(e.srv)
	defer front.Close()

	req, _ := http.NewRequest("POST", front.URL+"/process.Process/Start", strings.NewReader("{}"))
	req.Header.Set("E2b-Sandbox-Id", "s")
	req.Header.Set("E2b-Sandbox-Port", "49983")
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	line := make(chan string, 1)
	go func() {
		l, _ := bufio.NewReader(resp.Body).ReadString('\n')
		line <- l
	}()
	select {
	case l := <-line:
		if l != "first-envelope\n" {
			t.Fatalf("first chunk = %q", l)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("the first chunk was held back until the upstream finished (buffered proxy)")
	}
}

// TestProxyWebSocketUpgrade: upgrades are bridged both ways.
func TestProxyWebSocketUpgrade(t *testing.T) {
	e := newEnv(t)
	up := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.Header.Get("Upgrade") != "websocket" {
			http.Error(w, "want upgrade", 400)
			return
		}
		conn, brw, err := http.NewResponseController(w).Hijack()
		if err != nil {
			return
		}
		defer conn.Close()
		brw.WriteString("HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n\r\n")
		brw.Flush()
		l, _ := brw.ReadString('\n')
		brw.WriteString("echo:" + l)
		brw.Flush()
	}))
	defer up.Close()
	e.orch.add(&orchestrator.Sandbox{ID: "w", State: orchestrator.StateRunning})
	e.orch.endpoints["w"] = sandbox.Endpoint{Host: "127.0.0.1"}
	front := httptest.NewServer(e.srv)
	defer front.Close()
	conn, err := net.Dial("tcp", strings.TrimPrefix(front.URL, "http://"))
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	conn.SetDeadline(time.Now().Add(10 * time.Second))
	io.WriteString(conn, "GET /proxy/w/"+strconv.Itoa(portOf(t, up))+"/ws HTTP/1.1\r\nHost: x\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n\r\n")
	br := bufio.NewReader(conn)
	resp, err := http.ReadResponse(br, nil)
	if err != nil {
		t.Fatal(err)
	}
	if resp.StatusCode != 101 {
		t.Fatalf("status = %d", resp.StatusCode)
	}
	io.WriteString(conn, "hello\n")
	l, err := br.ReadString('\n')
	if err != nil || l != "echo:hello\n" {
		t.Fatalf("echo = %q, %v", l, err)
	}
}

// TestProxyStreamSurvivesUpstreamAnsweringBeforeBodyEOF: envd starts a Connect server
// stream (process.Start) as soon as it has the request envelope, and that can be before
// the proxy's transport has made its last read of the request body (after Content-Length
// bytes it reads once more to check for EOF). The gate holds the transport right there
// until the client has the response headers. Writing those headers must not drain and
// close the inbound body under the transport: the late read failed, the transport closed
// the upstream connection, and the stream was cut ("use of closed network connection" on
// the node, "terminated" in the SDK, on the first commands of a busy node).
func TestProxyStreamSurvivesUpstreamAnsweringBeforeBodyEOF(t *testing.T) {
	ea := relaytest.NewEarlyAnswer(t)
	tr := sandboxconn.NewTransport()
	t.Cleanup(tr.CloseIdleConnections)
	e := newEnv(t, func(o *Options) { o.Transport = ea.Transport(tr) })
	e.orch.add(&orchestrator.Sandbox{ID: "s", State: orchestrator.StateRunning})
	e.orch.endpoints["s"] = sandbox.Endpoint{Host: "127.0.0.1", EnvdPort: portOf(t, ea.Upstream)}
	front := httptest.NewServer(e.srv)
	t.Cleanup(front.Close)

	req, _ := http.NewRequest(http.MethodPost, front.URL+"/process.Process/Start", bytes.NewReader(relaytest.StreamMsg))
	req.Header.Set("E2b-Sandbox-Id", "s")
	req.Header.Set("E2b-Sandbox-Port", "49983")
	req.Header.Set("Content-Type", "application/connect+json")
	resp, err := front.Client().Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	cut, bodyErr := ea.Check(t, resp)
	if bodyErr != io.EOF {
		t.Errorf("the transport's last read of the request body: %v, want EOF", bodyErr)
	}
	if cut {
		t.Error("the proxy closed its upstream connection while the stream was running")
	}
}

// TestProxyRefusedUpstreamKeepsClientConnection: with full duplex, a request body nobody
// read used to be drained only after the handler returned, and net/http then panicked on
// the connection's next read (golang/go#68560) and dropped the client's keep-alive
// connection. A 502 for an unreachable sandbox must leave it usable.
func TestProxyRefusedUpstreamKeepsClientConnection(t *testing.T) {
	e, _, _ := proxyEnv(t)
	var logged strings.Builder
	var logMu sync.Mutex
	front := httptest.NewUnstartedServer(e.srv)
	front.Config.ErrorLog = log.New(writerFunc(func(p []byte) (int, error) {
		logMu.Lock()
		defer logMu.Unlock()
		return logged.Write(p)
	}), "", 0)
	front.Start()
	t.Cleanup(front.Close)

	conn, err := net.Dial("tcp", front.Listener.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	conn.SetDeadline(time.Now().Add(10 * time.Second))
	br := bufio.NewReader(conn)
	body := `{"path":"/tmp/x"}`
	for i := range 2 {
		fmt.Fprintf(conn, "POST /filesystem.Filesystem/Stat HTTP/1.1\r\nHost: x\r\nE2b-Sandbox-Id: gone\r\n"+
			"E2b-Sandbox-Port: 49983\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s", len(body), body)
		resp, err := http.ReadResponse(br, nil)
		if err != nil {
			logMu.Lock()
			t.Fatalf("request %d: %v (server log: %s)", i, err, logged.String())
		}
		io.Copy(io.Discard, resp.Body)
		resp.Body.Close()
		if resp.StatusCode != http.StatusBadGateway {
			t.Fatalf("request %d: status %d, want 502", i, resp.StatusCode)
		}
	}
	logMu.Lock()
	defer logMu.Unlock()
	if strings.Contains(logged.String(), "panic") {
		t.Fatalf("server log: %s", logged.String())
	}
}

type writerFunc func([]byte) (int, error)

func (f writerFunc) Write(p []byte) (int, error) { return f(p) }

// TestProxyKeepsConnectionsPerSandbox: a slot's address goes to the next sandbox as soon as
// one is killed, and a keep-alive connection to the killed sandbox can still be pooled (its
// FIN lost with its network namespace). Handed to the new sandbox's first request, it was
// reset by the new sandbox's kernel: a 502 (bench create at concurrency 8). Requests for
// another sandbox on the same address must get connections of their own; one sandbox's
// requests still share them.
func TestProxyKeepsConnectionsPerSandbox(t *testing.T) {
	e := newEnv(t)
	peers := make(chan string, 8)
	up := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		peers <- r.RemoteAddr
		io.WriteString(w, "ok")
	}))
	t.Cleanup(up.Close)
	for _, id := range []string{"killed", "next"} {
		e.orch.add(&orchestrator.Sandbox{ID: id, State: orchestrator.StateRunning})
		e.orch.endpoints[id] = sandbox.Endpoint{Host: "127.0.0.1", EnvdPort: portOf(t, up)}
	}
	front := httptest.NewServer(e.srv)
	t.Cleanup(front.Close)
	t.Cleanup(e.srv.proxy.rp.Transport.(interface{ CloseIdleConnections() }).CloseIdleConnections)

	via := func(id string) string {
		t.Helper()
		req, _ := http.NewRequest(http.MethodPost, front.URL+"/filesystem.Filesystem/Stat", strings.NewReader(`{"path":"/"}`))
		req.Header.Set("E2b-Sandbox-Id", id)
		req.Header.Set("E2b-Sandbox-Port", "49983")
		resp, err := front.Client().Do(req)
		if err != nil {
			t.Fatal(err)
		}
		b, err := io.ReadAll(resp.Body)
		resp.Body.Close()
		if err != nil || resp.StatusCode != http.StatusOK || string(b) != "ok" {
			t.Fatalf("via %s: %d %q %v", id, resp.StatusCode, b, err)
		}
		return <-peers
	}
	first := via("killed")
	if again := via("killed"); again != first {
		t.Fatalf("one sandbox's requests used connections %s and %s; want the pooled one again", first, again)
	}
	if next := via("next"); next == first {
		t.Fatalf("sandbox next got sandbox killed's pooled connection %s", first)
	}
}
