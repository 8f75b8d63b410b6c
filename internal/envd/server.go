package envd

import (
	"encoding/json"
	"log/slog"
	"math"
	"net/http"
	"sync/atomic"
	"time"

	"connectrpc.com/connect"

	"github.com/aenv-dev/aenv/internal/envd/files"
	"github.com/aenv-dev/aenv/internal/envd/filesystem"
	"github.com/aenv-dev/aenv/internal/envd/gen/filesystem/filesystemconnect"
	"github.com/aenv-dev/aenv/internal/envd/gen/process/processconnect"
	"github.com/aenv-dev/aenv/internal/envd/identity"
	"github.com/aenv-dev/aenv/internal/envd/process"
	"github.com/aenv-dev/aenv/internal/envd/reaper"
	"github.com/aenv-dev/aenv/internal/envd/state"
)

// Config configures a Server.
type Config struct {
	Users    identity.DB     // zero value: /etc/passwd, /etc/group
	Defaults *state.Defaults // nil: default user root, no token
	Waiter   reaper.Waiter   // nil: wait4 per child
	Logger   *slog.Logger
	// RunDir, when set, receives .E2B_SANDBOX_ID / .E2B_TEMPLATE_ID from /init env vars (E2B writes /run/e2b).
	RunDir string
	// DiskPath is the filesystem /metrics reports (default "/").
	DiskPath string
	// SetClock makes /init set the system clock from the request's timestamp when the
	// clock is behind it: a VM's clock lags after a restore by the snapshot's age (and
	// starts from the RTC's whole seconds at boot). Containers share the host's clock.
	SetClock bool
	// SetHostname makes /init set the host name to the sandbox's id (E2B_SANDBOX_ID,
	// cut to 63 bytes) when it differs: a VM restored from a capture keeps the name of
	// the sandbox it was captured from, where a container's runtime names each one.
	SetHostname bool
	// HostsFile, when set, is the hosts file /init adds the sandbox's host name to (the
	// sandbox's /etc/hosts): its name is its id, which no DNS server resolves.
	HostsFile string
	// RandomDevice is the kernel random device /init's entropy goes to (default
	// /dev/urandom); tests point it at a file to make the reseed fail.
	RandomDevice string
}

// Server is envd's HTTP handler.
type Server struct {
	cfg      Config
	Process  *process.Service
	FS       *filesystem.Service
	files    *files.Handler
	metrics  *metricsSampler
	mux      *http.ServeMux
	defaults *state.Defaults
	requests atomic.Int64
	trimmer  atomic.Pointer[idleTrimmer] // nil: no idle trim
}

// New builds a Server.
func New(cfg Config) *Server {
	if cfg.Defaults == nil {
		cfg.Defaults = state.New("root")
	}
	if cfg.RandomDevice == "" {
		cfg.RandomDevice = "/dev/urandom"
	}
	if cfg.Logger == nil {
		cfg.Logger = slog.Default()
	}
	if cfg.DiskPath == "" {
		cfg.DiskPath = "/"
	}
	s := &Server{cfg: cfg, defaults: cfg.Defaults, mux: http.NewServeMux(), metrics: newMetricsSampler(cfg.DiskPath)}
	s.Process = process.New(process.Options{Defaults: cfg.Defaults, Users: cfg.Users, Waiter: cfg.Waiter, Logger: cfg.Logger})
	s.FS = filesystem.New(cfg.Defaults, cfg.Users)
	s.files = &files.Handler{Defaults: cfg.Defaults, Users: cfg.Users, Logger: cfg.Logger}

	opts := []connect.HandlerOption{
		// Accept gzip-compressed requests but never compress responses: envd is reached over
		// loopback or a local proxy, where compressing process output only costs CPU (a Go client
		// asking for gzip cut stdout throughput by more than half).
		connect.WithCompressMinBytes(math.MaxInt),
		connect.WithReadMaxBytes(64 << 20),
		connect.WithCodec(jsonCodec{}),
	}
	pp, ph := processconnect.NewProcessHandler(s.Process, opts...)
	fp, fh := filesystemconnect.NewFilesystemHandler(s.FS, opts...)
	s.mux.Handle(pp, s.rpcAuth(ph))
	s.mux.Handle(fp, s.rpcAuth(fh))
	s.mux.HandleFunc("/health", s.health)
	s.mux.HandleFunc("/init", s.init)
	s.mux.Handle("/envs", s.restAuth(http.HandlerFunc(s.envs)))
	s.mux.Handle("/metrics", s.restAuth(http.HandlerFunc(s.metricsHandler)))
	s.mux.Handle("/files", s.files)
	s.mux.Handle("/files/compose", s.restAuth(http.HandlerFunc(s.files.Compose)))
	s.mux.HandleFunc("/", func(w http.ResponseWriter, r *http.Request) {
		files.Error(w, http.StatusNotFound, "not found: "+r.URL.Path)
	})
	return s
}

// ServeHTTP implements http.Handler.
func (s *Server) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	s.requests.Add(1)
	if t := s.trimmer.Load(); t != nil {
		t.poke()
	}
	s.mux.ServeHTTP(w, r)
}

// TrimWhenIdle returns freed memory to the OS once a burst of requests is over (no request
// for interval), so that an idle sandbox keeps a small RSS. It returns a func that stops it.
//
// A trim is a full collection, and an envd's first one leaves about 1.1 MiB of the
// collector's own memory resident (see lazygc), so it trims only when the heap's objects,
// live or garbage, grew by at least minGrowth bytes since the last trim (or the start): a
// burst that left less garbage than that would cost more than it returns. 0: after every
// burst. Between bursts it holds no timer (see idleTrimmer).
func (s *Server) TrimWhenIdle(interval time.Duration, minGrowth int64) (stop func()) {
	t := newIdleTrimmer(interval, minGrowth, &s.requests)
	s.trimmer.Store(t)
	return func() {
		s.trimmer.CompareAndSwap(t, nil)
		t.stop()
	}
}

// Close releases watchers.
func (s *Server) Close() { s.FS.Close() }

func (s *Server) tokenOK(r *http.Request) bool {
	return s.defaults.CheckToken(r.Header.Get("X-Access-Token"))
}

// rpcAuth rejects RPCs without the access token with a Connect unauthenticated error.
func (s *Server) rpcAuth(next http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if !s.tokenOK(r) {
			w.Header().Set("Content-Type", "application/json")
			w.WriteHeader(http.StatusUnauthorized)
			_ = json.NewEncoder(w).Encode(map[string]string{"code": "unauthenticated", "message": "missing or invalid access token"})
			return
		}
		next.ServeHTTP(w, r)
	})
}

// restAuth rejects REST calls without the access token with {"code":401,...}.
func (s *Server) restAuth(next http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if !s.tokenOK(r) {
			files.Error(w, http.StatusUnauthorized, "missing or invalid access token")
			return
		}
		next.ServeHTTP(w, r)
	})
}

func (s *Server) health(w http.ResponseWriter, r *http.Request) {
	if r.Method != http.MethodGet && r.Method != http.MethodHead {
		files.Error(w, http.StatusMethodNotAllowed, "method not allowed")
		return
	}
	w.Header().Set("Cache-Control", "no-store")
	w.Header().Set("X-Envd-Version", Version)
	w.WriteHeader(http.StatusNoContent)
}

func (s *Server) envs(w http.ResponseWriter, r *http.Request) {
	if r.Method != http.MethodGet {
		files.Error(w, http.StatusMethodNotAllowed, "method not allowed")
		return
	}
	writeJSON(w, s.defaults.Snapshot().EnvVars)
}

func writeJSON(w http.ResponseWriter, v any) {
	w.Header().Set("Content-Type", "application/json; charset=utf-8")
	w.Header().Set("Cache-Control", "no-store")
	_ = json.NewEncoder(w).Encode(v)
}
