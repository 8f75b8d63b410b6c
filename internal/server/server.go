// Package server is the node's HTTP front: the E2B-compatible control plane (generated from
// api/openapi.yaml), API-key auth, the reverse proxy that carries SDK traffic to envd and to
// user ports inside sandboxes, and the Prometheus endpoint.
//
// One listener serves both kinds of traffic (E2B single-server mode): a request that carries
// E2b-Sandbox-Id, a /proxy/{id}/{port}/ path, a {port}-{id}.{domain} host or a signed /files
// URL is sandbox traffic; everything else is the control plane.
package server

import (
	"context"
	"crypto/rand"
	"errors"
	"fmt"
	"log/slog"
	"net/http"
	"net/url"
	"strings"
	"sync/atomic"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/aenv-dev/aenv/internal/orchestrator"
	"github.com/aenv-dev/aenv/internal/sandbox"
	"github.com/aenv-dev/aenv/internal/server/api"
)

// EnvdPort is the port the SDKs address envd on (E2b-Sandbox-Port: 49983).
const EnvdPort = 49983

// Orchestrator is what the HTTP layer needs from the node's orchestrator.
type Orchestrator interface {
	Create(ctx context.Context, req orchestrator.CreateRequest) (*orchestrator.Sandbox, error)
	Connect(ctx context.Context, id string, o orchestrator.ConnectOptions) (sb *orchestrator.Sandbox, resumed bool, err error)
	Get(ctx context.Context, id string) (*orchestrator.Sandbox, error)
	List(ctx context.Context, f orchestrator.ListFilter) (items []*orchestrator.Sandbox, nextToken string, err error)
	Kill(ctx context.Context, id string) error
	SetTimeout(ctx context.Context, id string, d time.Duration) error
	Refresh(ctx context.Context, id string, d time.Duration) error
	Pause(ctx context.Context, id string, o sandbox.PauseOptions) error
	Metrics(ctx context.Context, id string) ([]sandbox.Stats, error)
	Endpoint(ctx context.Context, id string, autoResume bool) (sandbox.Endpoint, *orchestrator.Sandbox, error)
	Snapshot(ctx context.Context, id, name string) (orchestrator.SnapshotInfo, error)
	ListSnapshots(ctx context.Context, f orchestrator.SnapshotFilter) (items []orchestrator.SnapshotInfo, nextToken string, err error)
	DeleteTemplate(ctx context.Context, idOrName string) error
	Fork(ctx context.Context, id string, count int, timeout time.Duration) ([]orchestrator.ForkResult, error)
	Capabilities() sandbox.Capabilities
	BackendName() string
	// Config reports the node's settings; the API reads the default resources from it to
	// show what a template without its own CPU and memory runs with.
	Config() orchestrator.Config
}

// Authenticator checks an API key from X-API-Key: ok is false for an unknown or revoked
// key; err is reserved for failures of the check itself.
type Authenticator interface {
	Authenticate(ctx context.Context, key string) (ok bool, err error)
}

// Options configure a Server.
type Options struct {
	Orchestrator Orchestrator
	// Auth checks API keys; required (the node never serves its API unauthenticated).
	Auth Authenticator
	// Keys serves /aenv/keys (key management over the API); nil answers 404 there.
	Keys KeyManager
	// Builds serves the template build and template endpoints; nil answers 501 there.
	Builds TemplateBuilder
	// Pulls serves POST /aenv/templates/pull; nil answers 501 there.
	Pulls *Puller
	// Volumes serves /volumes and /volumecontent; nil answers 501 there.
	Volumes VolumeStore
	// NodeName names this node in the refusal of a volume it does not hold (volumes are
	// node-local).
	NodeName string
	// Secrets serves /secrets and expands secret placeholders at create; nil answers 501.
	Secrets SecretStore
	// Domains enable host routing of {port}-{id}.{domain}; the first one is reported to
	// clients as the sandbox domain.
	Domains []string
	// Registry receives the HTTP metrics and is served on /metrics. Nil: a private registry.
	Registry *prometheus.Registry
	// MetricsToken, when set, is the bearer token /metrics requires. MetricsElsewhere
	// serves /metrics only through MetricsHandler (a listener of its own): the API's
	// /metrics answers 404.
	MetricsToken     string
	MetricsElsewhere bool
	// Transport reaches sandboxes; nil uses a transport suited to long-lived streams.
	Transport http.RoundTripper
	// DefaultTimeout is the TTL of v2 creates and connects and of refreshes without a
	// duration (default 300 s).
	DefaultTimeout time.Duration
	// DefaultTimeoutV1 is the TTL of v1 creates without a timeout (default 15 s, E2B's spec).
	DefaultTimeoutV1 time.Duration
	// MaxTimeout caps requested TTLs (default 24 h).
	MaxTimeout time.Duration
	// Capacity refuses creates and template builds that ask for more than the node can
	// ever give, before anything starts (the orchestrator enforces it too). Zero: no limit.
	Capacity orchestrator.Capacity
	Logger   *slog.Logger
}

// Server serves the control plane and sandbox traffic on one handler.
type Server struct {
	// drain is set once the node joins a cluster (HandleDrain).
	drain  atomic.Pointer[drainRoute]
	orch   Orchestrator
	auth   Authenticator
	keys   KeyManager
	builds TemplateBuilder
	puller *Puller
	vols   *volumeGuard
	node   string
	secs   SecretStore
	// uploadKey signs the upload URLs of template builds (valid for this process's life).
	uploadKey []byte
	domains   []string
	registry  *prometheus.Registry
	// metricsToken and metricsElsewhere: see Options.
	metricsToken     string
	metricsElsewhere bool
	metrics          *httpMetrics
	mux              *http.ServeMux
	proxy            *sandboxProxy
	log              *slog.Logger

	defaultTimeout   time.Duration
	defaultTimeoutV1 time.Duration
	maxTimeout       time.Duration
	capacity         orchestrator.Capacity
}

// New builds a Server. It fails when a required option is missing or the metrics cannot
// be registered.
func New(o Options) (*Server, error) {
	if o.Orchestrator == nil {
		return nil, errors.New("server: Orchestrator is required")
	}
	if o.Auth == nil {
		return nil, errors.New("server: Auth is required")
	}
	s := &Server{
		orch:             o.Orchestrator,
		auth:             o.Auth,
		keys:             o.Keys,
		builds:           o.Builds,
		puller:           o.Pulls,
		vols:             newVolumeGuard(o.Volumes),
		node:             o.NodeName,
		secs:             o.Secrets,
		uploadKey:        randomKey(),
		domains:          normalizeDomains(o.Domains),
		registry:         o.Registry,
		metricsToken:     o.MetricsToken,
		metricsElsewhere: o.MetricsElsewhere,
		log:              o.Logger,
		defaultTimeout:   o.DefaultTimeout,
		defaultTimeoutV1: o.DefaultTimeoutV1,
		maxTimeout:       o.MaxTimeout,
		capacity:         o.Capacity,
	}
	if s.registry == nil {
		s.registry = prometheus.NewRegistry()
	}
	if s.log == nil {
		s.log = slog.Default()
	}
	if s.defaultTimeout <= 0 {
		s.defaultTimeout = 300 * time.Second
	}
	if s.defaultTimeoutV1 <= 0 {
		s.defaultTimeoutV1 = 15 * time.Second
	}
	if s.maxTimeout <= 0 {
		s.maxTimeout = 24 * time.Hour
	}
	m, err := newHTTPMetrics(s.registry)
	if err != nil {
		return nil, err
	}
	s.metrics = m
	s.proxy = newSandboxProxy(s.orch, o.Transport, s.log)

	s.mux = http.NewServeMux()
	// Unmatched control-plane routes still answer E2B's JSON error shape: 405 when the
	// path is served with other methods, 404 otherwise.
	s.mux.HandleFunc("/", s.unmatched)
	api.HandlerWithOptions(&handlers{s: s}, api.StdHTTPServerOptions{
		BaseRouter:       routeMux{s.mux},
		Middlewares:      []api.MiddlewareFunc{s.requireAPIKey},
		ErrorHandlerFunc: paramError,
	})
	return s, nil
}

// ServeHTTP routes a request to a sandbox or to the control plane. The sandbox header wins
// over the path, because /health and /metrics exist on both sides.
func (s *Server) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	start := time.Now()
	rec := &statusRecorder{ResponseWriter: w, status: http.StatusOK}
	source, route := s.dispatch(rec, r)
	s.metrics.observe(r.Method, route, source, rec.status, time.Since(start))
}

// dispatch serves r and returns the metric labels route_source and route.
func (s *Server) dispatch(w http.ResponseWriter, r *http.Request) (source, route string) {
	if hasSandboxHeaders(r) {
		s.proxy.byHeader(w, r)
		return "proxy_header", "sandbox"
	}
	if id, port, ok := s.hostTarget(r.Host); ok {
		s.proxy.forward(w, r, target{id: id, port: port, path: r.URL.Path, rawPath: r.URL.RawPath})
		return "proxy_host", "sandbox"
	}
	if strings.HasPrefix(r.URL.Path, "/proxy/") {
		s.proxy.byPath(w, r)
		return "proxy_prefix", "/proxy/*"
	}
	if r.URL.Path == "/files" && r.URL.Query().Has("signature") {
		s.proxy.bySignature(w, r)
		return "proxy_signed", "/files"
	}
	// A query the parser cannot decode would be dropped by r.URL.Query(), and a filter in
	// it silently ignored.
	if _, err := url.ParseQuery(r.URL.RawQuery); err != nil {
		writeError(w, http.StatusBadRequest, "malformed query string: %v", err)
		return "control_plane", "malformed_query"
	}
	// Handler only reports the pattern; ServeHTTP is what sets the path values.
	_, pattern := s.mux.Handler(r)
	s.mux.ServeHTTP(w, r)
	if pattern == "/" || pattern == "" {
		pattern = "unmatched"
	}
	return "control_plane", pattern
}

// requireAPIKey enforces X-API-Key on operations the contract marks as secured; the
// generated wrapper puts the scheme's scopes in the context for exactly those.
func (s *Server) requireAPIKey(next http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.Context().Value(api.ApiKeyAuthScopes) == nil {
			next.ServeHTTP(w, r)
			return
		}
		key := r.Header.Get("X-API-Key")
		if key == "" {
			writeError(w, http.StatusUnauthorized, "missing API key: send it in the X-API-Key header")
			return
		}
		ok, err := s.auth.Authenticate(r.Context(), key)
		if err != nil {
			s.log.Error("authenticate API key", "err", err)
			writeError(w, http.StatusInternalServerError, "checking the API key failed: %v", err)
			return
		}
		if !ok {
			writeError(w, http.StatusUnauthorized, "invalid API key")
			return
		}
		next.ServeHTTP(w, r.WithContext(withOwner(r.Context(), OwnerOf(key))))
	})
}

// paramError answers a query or path parameter the generated binder could not parse.
func paramError(w http.ResponseWriter, _ *http.Request, err error) {
	writeError(w, http.StatusBadRequest, "%s", err.Error())
}

// domain is the sandbox domain reported to clients: nil unless host routing is configured,
// because the SDK builds https URLs from it.
func (s *Server) domain() *string {
	if len(s.domains) == 0 {
		return nil
	}
	d := s.domains[0]
	return &d
}

func normalizeDomains(in []string) []string {
	out := make([]string, 0, len(in))
	for _, d := range in {
		d = strings.ToLower(strings.TrimSpace(strings.TrimPrefix(d, ".")))
		if d != "" {
			out = append(out, d)
		}
	}
	return out
}

// statusRecorder remembers the status for metrics. Unwrap lets http.ResponseController
// (used by httputil.ReverseProxy) reach Flush and Hijack on the real writer.
type statusRecorder struct {
	http.ResponseWriter
	status      int
	wroteHeader bool
}

func (r *statusRecorder) WriteHeader(code int) {
	if !r.wroteHeader && code >= 200 {
		r.status = code
		r.wroteHeader = true
	}
	r.ResponseWriter.WriteHeader(code)
}

func (r *statusRecorder) Write(b []byte) (int, error) {
	r.wroteHeader = true
	return r.ResponseWriter.Write(b)
}

// Flush keeps streaming working for callers that type-assert http.Flusher.
func (r *statusRecorder) Flush() {
	if err := http.NewResponseController(r.ResponseWriter).Flush(); err != nil {
		slog.Debug("flush", "err", err)
	}
}

func (r *statusRecorder) Unwrap() http.ResponseWriter { return r.ResponseWriter }

// handlers implements api.ServerInterface; it is a separate type so the generated method
// names do not clutter Server's API.
type handlers struct{ s *Server }

var _ api.ServerInterface = (*handlers)(nil)

func (h *handlers) GetHealth(w http.ResponseWriter, _ *http.Request) {
	w.Header().Set("Cache-Control", "no-store")
	w.WriteHeader(http.StatusNoContent)
}

func (h *handlers) GetPrometheusMetrics(w http.ResponseWriter, r *http.Request) {
	if h.s.metricsElsewhere {
		writeError(w, http.StatusNotFound, "/metrics is served on the node's metrics_listen address")
		return
	}
	h.s.MetricsHandler().ServeHTTP(w, r)
}

// timeoutSeconds validates a requested TTL in seconds and applies the default when absent.
func (s *Server) timeoutSeconds(v *int32, def time.Duration) (time.Duration, error) {
	if v == nil {
		return def, nil
	}
	d := time.Duration(*v) * time.Second
	if *v <= 0 || d > s.maxTimeout {
		return 0, fmt.Errorf("timeout must be between 1 and %d seconds, got %d", int(s.maxTimeout/time.Second), *v)
	}
	return d, nil
}

// randomKey returns 32 random bytes (crypto/rand does not fail on Linux).
func randomKey() []byte {
	k := make([]byte, 32)
	rand.Read(k)
	return k
}

// methodsToTry are the methods a 405's Allow header can name.
var methodsToTry = []string{http.MethodGet, http.MethodHead, http.MethodPost, http.MethodPut, http.MethodPatch, http.MethodDelete}

// unmatched answers a control-plane request no route took.
func (s *Server) unmatched(w http.ResponseWriter, r *http.Request) {
	var allow []string
	for _, m := range methodsToTry {
		if m == r.Method {
			continue
		}
		probe := r.Clone(r.Context())
		probe.Method = m
		if _, pattern := s.mux.Handler(probe); pattern != "/" && pattern != "" {
			allow = append(allow, m)
		}
	}
	if len(allow) > 0 {
		w.Header().Set("Allow", strings.Join(allow, ", "))
		writeError(w, http.StatusMethodNotAllowed, "method %s not allowed on %s (allowed: %s)", r.Method, r.URL.Path, strings.Join(allow, ", "))
		return
	}
	writeError(w, http.StatusNotFound, "route not found: %s %s", r.Method, r.URL.Path)
}
