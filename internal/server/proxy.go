package server

import (
	"context"
	"crypto/subtle"
	"errors"
	"log/slog"
	"net"
	"net/http"
	"net/http/httputil"
	"net/url"
	"path"
	"strconv"
	"strings"
	"sync"

	"github.com/aenv-dev/aenv/internal/orchestrator"
	"github.com/aenv-dev/aenv/internal/relay"
	"github.com/aenv-dev/aenv/internal/sandboxconn"
)

// Headers of sandbox traffic (E2B data-plane conventions).
const (
	headerSandboxID    = "E2b-Sandbox-Id"
	headerSandboxPort  = "E2b-Sandbox-Port"
	headerAccessToken  = "X-Access-Token"
	headerTrafficToken = "E2b-Traffic-Access-Token"
	// AgentENV's names for the routing headers, accepted as aliases so its users can switch
	// without changing clients.
	headerAgentenvID   = "X-Agentenv-Sandbox-Id"
	headerAgentenvPort = "X-Agentenv-Target-Port"
)

// envdInternalPaths are envd endpoints only the node may call (init, pause hooks); the proxy
// never forwards them from outside.
var envdInternalPaths = map[string]bool{
	"/init": true, "/freeze": true, "/unfreeze": true, "/fsfreeze": true, "/fsthaw": true,
	"/collapse": true, "/upgrade": true,
}

// target is where one proxied request goes: a sandbox port and the upstream path.
type target struct {
	id      string
	port    int
	path    string
	rawPath string
}

// upstream is the resolved address of a target, carried to Rewrite in the context.
type upstream struct {
	hostPort string
	path     string
	rawPath  string
	envd     bool
	// host is the Host the request carries in (network.maskRequestHost); empty: hostPort.
	host string
}

type upstreamKey struct{}

// sandboxProxy forwards sandbox traffic. Responses are streamed (FlushInterval -1) so Connect
// server streams, SSE and chunked downloads reach the client as they are produced; upgrades
// (WebSocket) are bridged by httputil.ReverseProxy.
type sandboxProxy struct {
	orch Orchestrator
	rp   *httputil.ReverseProxy
	log  *slog.Logger
}

func newSandboxProxy(orch Orchestrator, transport http.RoundTripper, log *slog.Logger) *sandboxProxy {
	if transport == nil {
		transport = sandboxconn.New()
	}
	p := &sandboxProxy{orch: orch, log: log}
	p.rp = &httputil.ReverseProxy{
		Rewrite:       rewrite,
		Transport:     transport,
		FlushInterval: -1,
		ErrorHandler:  p.upstreamError,
		BufferPool:    &bufferPool{},
	}
	return p
}

// bufferPool reuses the proxy's copy buffers instead of allocating 32 KiB per request.
type bufferPool struct{ p sync.Pool }

func (b *bufferPool) Get() []byte {
	if v, ok := b.p.Get().(*[]byte); ok {
		return *v
	}
	return make([]byte, 32*1024)
}

func (b *bufferPool) Put(buf []byte) { b.p.Put(&buf) }

func rewrite(pr *httputil.ProxyRequest) {
	u, _ := pr.In.Context().Value(upstreamKey{}).(*upstream)
	if u == nil {
		return // forward always sets it; an empty URL makes the transport fail into a 502
	}
	pr.Out.URL.Scheme = "http"
	pr.Out.URL.Host = u.hostPort
	pr.Out.URL.Path = u.path
	pr.Out.URL.RawPath = u.rawPath
	pr.Out.Host = u.hostPort
	if u.host != "" {
		pr.Out.Host = u.host
	}
	pr.SetXForwarded()
	h := pr.Out.Header
	h.Del(headerSandboxID)
	h.Del(headerSandboxPort)
	h.Del(headerAgentenvID)
	h.Del(headerAgentenvPort)
	h.Del(headerTrafficToken)
	// The API key never travels into a sandbox, and a user port never sees the envd token.
	h.Del("X-API-Key")
	if !u.envd {
		h.Del(headerAccessToken)
	}
}

// upstreamError answers a failed upstream round trip: the sandbox is unreachable, which the
// SDKs read as "not running" from a 502.
func (p *sandboxProxy) upstreamError(w http.ResponseWriter, r *http.Request, err error) {
	if errors.Is(err, context.Canceled) && r.Context().Err() != nil {
		return // the client went away
	}
	id, _ := r.Context().Value(sandboxIDKey{}).(string)
	p.log.Debug("sandbox upstream failed", "sandbox", id, "path", r.URL.Path, "err", err)
	writeGone(w, id, "The sandbox is not reachable: "+err.Error())
}

type sandboxIDKey struct{}

// writeGone is infra's answer for a sandbox that is not running; the SDK's isRunning()
// and its "sandbox is probably not running" errors depend on the 502.
func writeGone(w http.ResponseWriter, id, msg string) {
	writeJSON(w, http.StatusBadGateway, map[string]any{"sandboxId": id, "message": msg, "code": http.StatusBadGateway})
}

// writePaused is E2B's answer for a paused sandbox that traffic may not resume (it was
// created without autoResume).
func writePaused(w http.ResponseWriter, id string) {
	writeJSON(w, http.StatusConflict, map[string]any{
		"sandboxId": id, "message": "The sandbox is paused", "code": http.StatusConflict, "canAutoResume": false,
	})
}

func hasSandboxHeaders(r *http.Request) bool {
	return headerValue(r, headerSandboxID, headerAgentenvID) != "" ||
		headerValue(r, headerSandboxPort, headerAgentenvPort) != ""
}

// headerValue is the E2B header, or AgentENV's alias when the E2B one is absent.
func headerValue(r *http.Request, e2b, alias string) string {
	if v := r.Header.Get(e2b); v != "" {
		return v
	}
	return r.Header.Get(alias)
}

// byHeader routes by E2b-Sandbox-Id / E2b-Sandbox-Port (or AgentENV's aliases), keeping the
// path as sent, less a leading /proxy: AgentENV users point the SDK at $URL/proxy
// (E2B_SANDBOX_URL), and its requests then carry both the prefix and the headers.
func (p *sandboxProxy) byHeader(w http.ResponseWriter, r *http.Request) {
	id := headerValue(r, headerSandboxID, headerAgentenvID)
	portStr := headerValue(r, headerSandboxPort, headerAgentenvPort)
	if id == "" {
		writeError(w, http.StatusBadRequest, "Missing header: %s (or %s)", headerSandboxID, headerAgentenvID)
		return
	}
	if portStr == "" {
		writeError(w, http.StatusBadRequest, "Missing header: %s (or %s)", headerSandboxPort, headerAgentenvPort)
		return
	}
	port, err := parsePort(portStr)
	if err != nil {
		writeError(w, http.StatusBadRequest, "invalid %s header: %v", headerSandboxPort, err)
		return
	}
	t := target{id: id, port: port, path: r.URL.Path, rawPath: r.URL.RawPath}
	if rest, ok := strings.CutPrefix(t.path, "/proxy"); ok && (rest == "" || rest[0] == '/') {
		t.path = "/" + strings.TrimPrefix(rest, "/")
		if t.rawPath != "" {
			t.rawPath = "/" + strings.TrimPrefix(strings.TrimPrefix(t.rawPath, "/proxy"), "/")
		}
	}
	p.forward(w, r, t)
}

// byPath routes /proxy/{id}/{port}/{rest...} to /{rest...} on that port; the escaped form of
// the rest is preserved (a %2F stays encoded).
func (p *sandboxProxy) byPath(w http.ResponseWriter, r *http.Request) {
	rest := strings.TrimPrefix(r.URL.EscapedPath(), "/proxy/")
	parts := strings.SplitN(rest, "/", 3)
	if len(parts) < 2 || parts[0] == "" || parts[1] == "" {
		writeError(w, http.StatusBadRequest, "proxy paths look like /proxy/{sandboxID}/{port}/{path}, got %s", r.URL.Path)
		return
	}
	id, err := url.PathUnescape(parts[0])
	if err != nil {
		writeError(w, http.StatusBadRequest, "invalid sandbox ID in proxy path: %v", err)
		return
	}
	port, err := parsePort(parts[1])
	if err != nil {
		writeError(w, http.StatusBadRequest, "invalid port in proxy path: %v", err)
		return
	}
	escaped := "/"
	if len(parts) == 3 {
		escaped += parts[2]
	}
	path, err := url.PathUnescape(escaped)
	if err != nil {
		writeError(w, http.StatusBadRequest, "invalid proxy path: %v", err)
		return
	}
	t := target{id: id, port: port, path: path}
	if escaped != (&url.URL{Path: path}).EscapedPath() {
		t.rawPath = escaped
	}
	p.forward(w, r, t)
}

func parsePort(s string) (int, error) {
	n, err := strconv.Atoi(s)
	if err != nil || n < 1 || n > 65535 {
		return 0, errors.New("port must be a number between 1 and 65535, got " + strconv.Quote(s))
	}
	return n, nil
}

// hostTarget parses a Host of the form {port}-{id}.{domain} for a configured domain. It
// splits at the first '-' only, so hyphenated sandbox IDs work.
func (s *Server) hostTarget(host string) (id string, port int, ok bool) {
	if len(s.domains) == 0 || host == "" {
		return "", 0, false
	}
	host = strings.ToLower(host)
	cands := []string{host}
	if h, _, err := net.SplitHostPort(host); err == nil {
		cands = append(cands, h)
	}
	for _, d := range s.domains {
		for _, c := range cands {
			label, found := strings.CutSuffix(c, "."+d)
			if !found || label == "" || strings.Contains(label, ".") {
				continue
			}
			portStr, sid, cut := strings.Cut(label, "-")
			if !cut || sid == "" {
				continue
			}
			n, err := parsePort(portStr)
			if err != nil {
				continue
			}
			return sid, n, true
		}
	}
	return "", 0, false
}

// forward checks the sandbox's tokens and proxies r to the target.
func (p *sandboxProxy) forward(w http.ResponseWriter, r *http.Request, t target) {
	ep, sb, err := p.orch.Endpoint(r.Context(), t.id, true)
	if err != nil {
		switch {
		case errors.Is(err, orchestrator.ErrNotFound):
			writeGone(w, t.id, "The sandbox was not found")
		case errors.Is(err, orchestrator.ErrPaused):
			writePaused(w, t.id)
		case errors.Is(err, orchestrator.ErrNotRunning):
			writeGone(w, t.id, "The sandbox is not running: "+err.Error())
		default:
			writeOrchError(w, r, err)
		}
		return
	}
	u := &upstream{path: t.path, rawPath: t.rawPath}
	if t.port == EnvdPort {
		if envdInternalPaths[path.Clean("/"+t.path)] {
			writeError(w, http.StatusForbidden, "%s is internal to the node and not reachable through the proxy", t.path)
			return
		}
		if !envdTokenExempt(r.Method, t.path) && !tokenMatches(r.Header.Get(headerAccessToken), sb.EnvdAccessToken) {
			writeError(w, http.StatusUnauthorized, "missing or invalid %s for sandbox %s", headerAccessToken, t.id)
			return
		}
		port := ep.EnvdPort
		if port == 0 {
			port = EnvdPort
		}
		u.hostPort = net.JoinHostPort(ep.Host, strconv.Itoa(port))
		u.envd = true
	} else {
		// User ports are public unless the sandbox was created with
		// allowPublicTraffic=false, as in E2B.
		if sb.Private && !tokenMatches(r.Header.Get(headerTrafficToken), sb.TrafficAccessToken) {
			writeError(w, http.StatusForbidden, "missing or invalid %s for private sandbox %s", headerTrafficToken, t.id)
			return
		}
		u.hostPort = net.JoinHostPort(ep.Host, strconv.Itoa(t.port))
		if sb.MaskRequestHost != "" {
			u.host = maskedHost(sb.MaskRequestHost, t.port)
		}
	}
	ctx := context.WithValue(r.Context(), upstreamKey{}, u)
	ctx = context.WithValue(ctx, sandboxIDKey{}, t.id)
	// The sandbox's own connections: addresses are reused, and the one the orchestrator
	// opened for /init is there to carry the first request.
	ctx = sandboxconn.WithSandbox(ctx, t.id)
	relay.Serve(p.rp, w, r.WithContext(ctx))
}

// envdTokenExempt: /health is public, and /files authorizes itself inside envd by header
// token or URL signature (E2B's rules).
func envdTokenExempt(method, path string) bool {
	switch path {
	case "/health":
		return true
	case "/files":
		return method == http.MethodGet || method == http.MethodHead || method == http.MethodPost
	}
	return false
}

// tokenMatches compares in constant time; an empty want means the sandbox has no token.
func tokenMatches(got, want string) bool {
	if want == "" {
		return true
	}
	return subtle.ConstantTimeCompare([]byte(got), []byte(want)) == 1
}
