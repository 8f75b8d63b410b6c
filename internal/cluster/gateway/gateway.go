// Package gateway serves a cluster's E2B-compatible API from one address and keeps no
// state of its own: a create asks the scheduler for a node and is forwarded there; a
// sandbox-scoped call (REST path, envd traffic by header, host or /proxy) asks the
// scheduler where the sandbox lives and is forwarded there; lists are fanned out to every
// live node and merged with paging; everything else (templates) goes to any live node,
// which is correct because nodes share their repository. Gateways scale horizontally.
package gateway

import (
	"context"
	"crypto/subtle"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"net/http/httputil"
	"strings"
	"time"

	"google.golang.org/grpc"

	pb "github.com/aenv-dev/aenv/internal/cluster/scheduler/gen/schedulerv1"
)

// Scheduler is the part of the scheduler's client the gateway uses.
type Scheduler interface {
	Place(ctx context.Context, in *pb.PlaceRequest, opts ...grpc.CallOption) (*pb.PlaceResponse, error)
	Bind(ctx context.Context, in *pb.BindRequest, opts ...grpc.CallOption) (*pb.BindResponse, error)
	Release(ctx context.Context, in *pb.ReleaseRequest, opts ...grpc.CallOption) (*pb.ReleaseResponse, error)
	Lookup(ctx context.Context, in *pb.LookupRequest, opts ...grpc.CallOption) (*pb.LookupResponse, error)
	ListNodes(ctx context.Context, in *pb.ListNodesRequest, opts ...grpc.CallOption) (*pb.ListNodesResponse, error)
}

// Config configures a Gateway.
type Config struct {
	Scheduler Scheduler
	// APIKeys are the cluster's keys; every node must accept them too (AENV_API_KEY).
	APIKeys []string
	// Domains route Host {port}-{sandboxID}.{domain} to the sandbox, as on a node.
	Domains []string
	// Transport carries forwarded requests (default: a pooled http.Transport).
	Transport http.RoundTripper
	Logger    *slog.Logger
}

// Gateway is the cluster's HTTP front door.
type Gateway struct {
	sched   Scheduler
	keys    [][]byte
	domains []string
	proxy   *httputil.ReverseProxy
	client  *http.Client
	routes  routeCache
	log     *slog.Logger
}

const (
	headerSandboxID   = "E2b-Sandbox-Id"
	headerSandboxPort = "E2b-Sandbox-Port"
	// maxCreateBody bounds the create request the gateway reads to place the sandbox.
	maxCreateBody = 4 << 20
)

// New returns a gateway; it needs a scheduler and at least one API key.
func New(cfg Config) (*Gateway, error) {
	if cfg.Scheduler == nil {
		return nil, errors.New("gateway: a scheduler is required")
	}
	if len(cfg.APIKeys) == 0 {
		return nil, errors.New("gateway: the cluster's API key is required (AENV_API_KEY)")
	}
	if cfg.Logger == nil {
		cfg.Logger = slog.Default()
	}
	tr := cfg.Transport
	if tr == nil {
		tr = &http.Transport{
			Proxy:               nil,
			DialContext:         (&net.Dialer{Timeout: 5 * time.Second, KeepAlive: 30 * time.Second}).DialContext,
			MaxIdleConns:        1024,
			MaxIdleConnsPerHost: 256,
			IdleConnTimeout:     90 * time.Second,
		}
	}
	g := &Gateway{sched: cfg.Scheduler, log: cfg.Logger, client: &http.Client{Transport: tr}}
	for _, k := range cfg.APIKeys {
		g.keys = append(g.keys, []byte(k))
	}
	for _, d := range cfg.Domains {
		if d = strings.Trim(strings.ToLower(d), "."); d != "" {
			g.domains = append(g.domains, d)
		}
	}
	g.proxy = &httputil.ReverseProxy{
		Transport:     tr,
		FlushInterval: -1, // envd streams events; never buffer them
		Rewrite: func(r *httputil.ProxyRequest) {
			t := r.In.Context().Value(targetKey{}).(*target)
			r.SetURL(t.base)
			r.Out.URL.Path, r.Out.URL.RawPath = r.In.URL.Path, r.In.URL.RawPath
			r.Out.Host = r.In.Host // host routing on the node needs the original name
			r.SetXForwarded()
		},
		ModifyResponse: g.bindForked,
		ErrorHandler: func(w http.ResponseWriter, r *http.Request, err error) {
			t := r.Context().Value(targetKey{}).(*target)
			if t.sandbox != "" {
				g.routes.drop(t.sandbox)
			}
			g.log.Warn("forward to node failed", "node", t.node, "path", r.URL.Path, "err", err)
			writeError(w, http.StatusBadGateway, "node %s (%s) did not answer: %v", t.node, t.base, err)
		},
	}
	return g, nil
}

// ServeHTTP routes like a node does: sandbox headers, then host, then /proxy, then the
// control plane.
func (g *Gateway) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	if id := r.Header.Get(headerSandboxID); id != "" {
		g.toSandbox(w, r, id)
		return
	}
	if id, ok := g.hostSandbox(r.Host); ok {
		g.toSandbox(w, r, id)
		return
	}
	if rest, ok := strings.CutPrefix(r.URL.Path, "/proxy/"); ok {
		id, _, _ := strings.Cut(rest, "/")
		if id == "" {
			writeError(w, http.StatusBadRequest, "proxy paths look like /proxy/{sandboxID}/{port}/{path}, got %s", r.URL.Path)
			return
		}
		g.toSandbox(w, r, id)
		return
	}
	if r.URL.Path == "/health" {
		w.WriteHeader(http.StatusNoContent)
		return
	}
	if r.URL.Path == "/files" && r.URL.Query().Has("signature") {
		g.signedFile(w, r)
		return
	}
	if !g.authorized(w, r) {
		return
	}
	g.controlPlane(w, r)
}

func (g *Gateway) authorized(w http.ResponseWriter, r *http.Request) bool {
	key := r.Header.Get("X-API-Key")
	if key == "" {
		writeError(w, http.StatusUnauthorized, "missing API key: send it in the X-API-Key header")
		return false
	}
	for _, k := range g.keys {
		if subtle.ConstantTimeCompare([]byte(key), k) == 1 {
			return true
		}
	}
	writeError(w, http.StatusUnauthorized, "invalid API key")
	return false
}

// controlPlane routes REST calls: creates are placed, sandbox paths looked up, lists
// merged, the rest sent to any live node.
func (g *Gateway) controlPlane(w http.ResponseWriter, r *http.Request) {
	p := r.URL.Path
	switch {
	case r.Method == http.MethodPost && (p == "/sandboxes" || p == "/v2/sandboxes"):
		g.create(w, r)
	case r.Method == http.MethodGet && p == "/v2/sandboxes":
		g.listSandboxes(w, r, true)
	case r.Method == http.MethodGet && p == "/sandboxes":
		g.listSandboxes(w, r, false)
	case r.Method == http.MethodGet && p == "/snapshots":
		g.listSnapshots(w, r)
	case r.Method == http.MethodGet && p == "/nodes":
		g.nodes(w, r)
	case r.Method == http.MethodPost && strings.HasPrefix(p, "/nodes/"):
		id, draining, ok := nodeAction(p)
		if !ok {
			writeError(w, http.StatusNotFound, "no such node action %s (POST /nodes/{id}/drain or /nodes/{id}/undrain)", p)
			return
		}
		g.drain(w, r, id, draining)
	case p == "/sandboxes/metrics":
		g.toAnyNode(w, r)
	case nodeLocal(p):
		// Sent to any node, they would land on a different one each time.
		writeError(w, http.StatusNotImplemented, "%s is node-local (volumes and secrets live on the node that made them and are not "+
			"published to the repository): use a node's own API, not the gateway", p)
	default:
		if id, ok := isFork(r); ok {
			g.fork(w, r, id)
			return
		}
		if id, ok := sandboxOfPath(p); ok {
			g.toSandbox(w, r, id)
			return
		}
		g.toAnyNode(w, r)
	}
}

// sandboxOfPath extracts {id} from /sandboxes/{id}[/...] and /v2/sandboxes/{id}[/...].
func sandboxOfPath(p string) (string, bool) {
	rest, ok := strings.CutPrefix(p, "/v2/sandboxes/")
	if !ok {
		rest, ok = strings.CutPrefix(p, "/sandboxes/")
	}
	if !ok {
		return "", false
	}
	id, _, _ := strings.Cut(rest, "/")
	return id, id != ""
}

// hostSandbox reads {port}-{sandboxID}.{domain}.
func (g *Gateway) hostSandbox(host string) (string, bool) {
	if len(g.domains) == 0 || host == "" {
		return "", false
	}
	host = strings.ToLower(host)
	if h, _, err := net.SplitHostPort(host); err == nil {
		host = h
	}
	for _, d := range g.domains {
		label, found := strings.CutSuffix(host, "."+d)
		if !found || label == "" || strings.Contains(label, ".") {
			continue
		}
		if _, id, ok := strings.Cut(label, "-"); ok && id != "" {
			return id, true
		}
	}
	return "", false
}

// writeError writes E2B's error shape.
func writeError(w http.ResponseWriter, code int, format string, args ...any) {
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(code)
	_ = json.NewEncoder(w).Encode(map[string]any{"code": code, "message": fmt.Sprintf(format, args...)})
}

// nodeLocal reports whether p is an API of resources kept on one node only.
func nodeLocal(p string) bool {
	for _, pre := range []string{"/volumes", "/volumecontent/", "/secrets"} {
		if p == pre || strings.HasPrefix(p, strings.TrimSuffix(pre, "/")+"/") {
			return true
		}
	}
	return false
}
