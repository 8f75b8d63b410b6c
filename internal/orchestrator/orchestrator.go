package orchestrator

import (
	"context"
	"crypto/hmac"
	"crypto/rand"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"maps"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"sync"
	"sync/atomic"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/aenv-dev/aenv/internal/catalog"
	"github.com/aenv-dev/aenv/internal/sandbox"
)

// ShutdownAction is what Shutdown does with sandboxes that are still running.
type ShutdownAction string

const (
	// ShutdownPause pauses running sandboxes so they can be resumed after a restart.
	ShutdownPause ShutdownAction = "pause"
	// ShutdownStop kills running sandboxes and deletes their records.
	ShutdownStop ShutdownAction = "stop"
	// ShutdownKeep leaves them as they are; Start reconciles with whatever survived.
	ShutdownKeep ShutdownAction = "keep"
)

// Config is the orchestrator's configuration. Zero fields take the defaults noted.
type Config struct {
	// DefaultTimeout is the TTL when a create or connect asks for none (300 s). The v1
	// API's default of 15 s is the HTTP layer's business: it passes it explicitly.
	DefaultTimeout time.Duration
	// MaxTimeout bounds any requested TTL (24 h); larger requests are ErrInvalid.
	MaxTimeout time.Duration
	// DefaultResources fill request fields that neither the request nor the template set
	// (2 CPUs, 512 MiB, 2048 MiB disk).
	DefaultResources sandbox.Resources
	// MaxSandboxes caps sandboxes holding resources (0 = unlimited); beyond it create
	// fails with ErrCapacity. Paused sandboxes count unless the backend's pause releases
	// memory.
	MaxSandboxes int
	// Capacity is what the node can give (HostCapacity); zero fields are unlimited.
	Capacity Capacity
	// EnvdPort is envd's port when an instance's Endpoint does not name one (49983).
	EnvdPort int
	// EnvdReadyTimeout bounds the wait for envd's /health after a launch (30 s).
	EnvdReadyTimeout time.Duration
	// EnvdVersion is reported when envd's /init answer carries no X-Envd-Version (0.5.15).
	EnvdVersion string
	// OperationTimeout bounds one lifecycle operation; operations are detached from the
	// caller's context so a client disconnect never leaves a half-done transition (2 min).
	OperationTimeout time.Duration
	// ShutdownAction is what Shutdown does with running sandboxes (ShutdownPause).
	ShutdownAction ShutdownAction
	// Registerer receives the aenv_ metrics; nil uses a private registry.
	Registerer prometheus.Registerer
	// Logger defaults to slog.Default().
	Logger *slog.Logger
	// TemplatePending, when set, is asked about a template id the catalog does not know:
	// a non-nil answer (why it is not there yet: a build in progress or failed) makes
	// create fail with ErrTemplateNotReady instead of ErrTemplateNotFound.
	TemplatePending func(id string) error
	// TemplateFetch, when set, is asked about a template id the catalog does not know
	// before a create fails: it brings a template or snapshot another node published
	// since the last sync (a create placed here by a cluster gateway) and reports
	// whether the catalog has it now.
	TemplateFetch func(ctx context.Context, id string) (bool, error)
	// EgressCA is the node's egress CA certificate (PEM): sandboxes with network.rules are
	// given it to trust (egressca.go). Empty: none is installed.
	EgressCA []byte
}

func (c *Config) applyDefaults() {
	if c.DefaultTimeout <= 0 {
		c.DefaultTimeout = 300 * time.Second
	}
	if c.MaxTimeout <= 0 {
		c.MaxTimeout = 24 * time.Hour
	}
	if c.DefaultResources.CPUCount <= 0 {
		c.DefaultResources.CPUCount = 2
	}
	if c.DefaultResources.MemoryMB <= 0 {
		c.DefaultResources.MemoryMB = 512
	}
	if c.DefaultResources.DiskSizeMB <= 0 {
		c.DefaultResources.DiskSizeMB = 2048
	}
	if c.EnvdPort <= 0 {
		c.EnvdPort = 49983
	}
	if c.EnvdReadyTimeout <= 0 {
		c.EnvdReadyTimeout = 30 * time.Second
	}
	if c.EnvdVersion == "" {
		c.EnvdVersion = "0.5.15"
	}
	if c.OperationTimeout <= 0 {
		c.OperationTimeout = 2 * time.Minute
	}
	if c.ShutdownAction == "" {
		c.ShutdownAction = ShutdownPause
	}
	if c.Registerer == nil {
		c.Registerer = prometheus.NewRegistry()
	}
	if c.Logger == nil {
		c.Logger = slog.Default()
	}
}

// Option adjusts an Orchestrator at construction; tests use them to inject a clock or
// an HTTP client.
type Option func(*Orchestrator)

// WithClock replaces the wall clock (TTL arithmetic and expiry timers).
func WithClock(c Clock) Option { return func(o *Orchestrator) { o.clock = c } }

// WithEnvdClient replaces the HTTP client used for envd /health and /init.
func WithEnvdClient(c *http.Client) Option { return func(o *Orchestrator) { o.envd = c } }

// recordStore is where sandbox records are persisted (the catalog's Sandboxes store;
// tests wrap it to inject write failures).
type recordStore interface {
	Put(id string, rec []byte) error
	Delete(id string) error
	All() (map[string][]byte, error)
}

// Orchestrator owns every sandbox of one node. It is safe for concurrent use.
type Orchestrator struct {
	cfg     Config
	backend sandbox.Backend
	cat     *catalog.Catalog
	records recordStore
	log     *slog.Logger
	clock   Clock
	envd    *http.Client
	seed    []byte
	m       *metrics
	// quiet takes the lifecycle metrics of the template builder's sandboxes (registered
	// nowhere): the builder has metrics of its own, and they are not the node's sandboxes.
	quiet   *metrics
	pub     Publisher               // nil: nothing is published or pinned
	pins    PinLister               // nil: Start keeps every pin
	volumes Volumes                 // nil: creates with volume mounts are refused
	secrets Secrets                 // nil: secret placeholders reach envd unexpanded
	crashAt string                  // CrashPointEnv, read once at New (debug only)
	logs    *logStore               // sandbox logs (logs.go)
	handoff atomic.Pointer[handoff] // nil on a lone node (handoff.go)

	// regMu orders a snapshot's registration and publication (read side) before a
	// delete of the same entry (write side), so a delete that overtakes a snapshot
	// never leaves the snapshot published in the repository.
	regMu sync.RWMutex

	mu      sync.Mutex
	entries map[string]*entry
	closing bool
	bg      sync.WaitGroup // expiry goroutines
}

// entry is the in-memory state of one sandbox. All fields but pmu are guarded by
// Orchestrator.mu.
type entry struct {
	rec    Sandbox
	inst   sandbox.Instance    // nil while paused without a live instance
	paused sandbox.PausedState // set while paused in memory
	disk   sandbox.Captured    // set while paused to disk (decoded rec.DiskSnapshot)
	op     *op                 // non-nil while a transitional state is held
	timer  Stopper
	gone   bool // removed; late writers must not resurrect the record

	// pmu orders catalog writes of this sandbox so the last change always wins.
	pmu sync.Mutex
}

// op is one in-flight transition. Waiters block on done; joiners read err after it.
type op struct {
	kind State
	done chan struct{}
	err  error
}

// New builds an orchestrator. It reads (and on first use creates) the token seed in
// the catalog and registers metrics; call Start before serving requests.
func New(cfg Config, backend sandbox.Backend, cat *catalog.Catalog, opts ...Option) (*Orchestrator, error) {
	if backend == nil || cat == nil {
		return nil, errors.New("orchestrator: backend and catalog are required")
	}
	cfg.applyDefaults()
	switch cfg.ShutdownAction {
	case ShutdownPause, ShutdownStop, ShutdownKeep:
	default:
		return nil, fmt.Errorf("orchestrator: unknown shutdown action %q", cfg.ShutdownAction)
	}
	seed, err := cat.Secret("sandbox-token-seed", 32)
	if err != nil {
		return nil, fmt.Errorf("orchestrator: token seed: %w", err)
	}
	o := &Orchestrator{
		cfg:     cfg,
		backend: backend,
		cat:     cat,
		records: cat.Sandboxes(),
		log:     cfg.Logger.With("component", "orchestrator", "backend", backend.Name()),
		clock:   realClock{},
		envd:    newEnvdClient(),
		seed:    seed,
		entries: map[string]*entry{},
		crashAt: os.Getenv(CrashPointEnv),
		logs:    newLogStore(filepath.Join(filepath.Dir(cat.Path()), "sandbox-logs")),
	}
	for _, opt := range opts {
		opt(o)
	}
	o.armCrashPoint()
	if o.m, err = newMetrics(cfg.Registerer, o); err != nil {
		return nil, err
	}
	if o.quiet, err = newMetrics(prometheus.NewRegistry(), o); err != nil {
		return nil, err
	}
	return o, nil
}

// newEnvdClient talks to envd inside sandboxes. It never goes through an HTTP proxy
// from the environment (sandbox addresses are host-local) and keeps idle connections
// only briefly: each sandbox sees two or three requests at create, then none. A node
// gives the orchestrator NewEnvdClient over the proxy's connections instead.
func newEnvdClient() *http.Client {
	return NewEnvdClient(&http.Transport{
		Proxy:               nil,
		DialContext:         (&net.Dialer{Timeout: 2 * time.Second}).DialContext,
		MaxIdleConnsPerHost: 1,
		IdleConnTimeout:     5 * time.Second,
		DisableCompression:  true,
	})
}

// NewEnvdClient is the client for envd's /health, /init and files over rt. Given the
// sandbox proxy's transport (sandboxconn.Pools), the connection a create opens for
// /health and /init stays pooled as the sandbox's and carries its first proxied request
// (the SDK's first command), instead of that request dialing into the sandbox again.
func NewEnvdClient(rt http.RoundTripper) *http.Client {
	return &http.Client{Timeout: 5 * time.Second, Transport: rt}
}

// Capabilities reports what the backend can do.
func (o *Orchestrator) Capabilities() sandbox.Capabilities { return o.backend.Capabilities() }

// BackendName is the name of the backend sandboxes run on.
func (o *Orchestrator) BackendName() string { return o.backend.Name() }

// Backend is the backend sandboxes run on.
func (o *Orchestrator) Backend() sandbox.Backend { return o.backend }

// Config is the effective configuration (defaults applied).
func (o *Orchestrator) Config() Config { return o.cfg }

const idAlphabet = "abcdefghijklmnopqrstuvwxyz0123456789"

// newID returns 20 lowercase alphanumerics (E2B's id shape, safe in host names).
func newID() (string, error) {
	var out [20]byte
	var buf [32]byte
	n := 0
	for n < len(out) {
		if _, err := rand.Read(buf[:]); err != nil {
			return "", fmt.Errorf("generate sandbox id: %w", err)
		}
		for _, b := range buf {
			// Reject the top of the byte range so every character is equally likely.
			if int(b) >= 256/len(idAlphabet)*len(idAlphabet) || n == len(out) {
				continue
			}
			out[n] = idAlphabet[int(b)%len(idAlphabet)]
			n++
		}
	}
	return string(out[:]), nil
}

// token derives a per-sandbox secret from the node seed, so a sandbox keeps its tokens
// across pause, resume and node restarts without storing them separately.
func (o *Orchestrator) token(purpose, id string) string {
	mac := hmac.New(sha256.New, o.seed)
	mac.Write([]byte(purpose))
	mac.Write([]byte{0})
	mac.Write([]byte(id))
	return hex.EncodeToString(mac.Sum(nil)[:20])
}

// EnvdAccessToken is the envd token of sandbox id (whether or not it was issued).
func (o *Orchestrator) EnvdAccessToken(id string) string { return o.token("envd-access-token", id) }

// TrafficAccessToken is the user-port traffic token of sandbox id.
func (o *Orchestrator) TrafficAccessToken(id string) string {
	return o.token("traffic-access-token", id)
}

// clone returns a copy of the record the caller may keep.
func (e *entry) clone() *Sandbox {
	s := e.rec
	s.Metadata = maps.Clone(e.rec.Metadata)
	s.EnvVars = maps.Clone(e.rec.EnvVars)
	s.Launch.TemplateEnvVars = maps.Clone(e.rec.Launch.TemplateEnvVars)
	s.Paused = append([]byte(nil), e.rec.Paused...)
	if len(s.Paused) == 0 {
		s.Paused = nil
	}
	s.DiskSnapshot = append(json.RawMessage(nil), e.rec.DiskSnapshot...)
	if len(s.DiskSnapshot) == 0 {
		s.DiskSnapshot = nil
	}
	return &s
}

// waitOpts says how acquire treats an entry that is in a transitional state.
type waitOpts struct {
	join     State   // join an in-flight op of this kind and return its outcome
	conflict []State // fail fast with ErrConflict in these states instead of waiting
}

// acquire returns with o.mu held and the entry stable (no op in flight), or with o.mu
// released and either an error or a joined op whose outcome the caller reports.
func (o *Orchestrator) acquire(ctx context.Context, id string, w waitOpts) (*entry, *op, error) {
	for {
		o.mu.Lock()
		e := o.entries[id]
		if e == nil {
			o.mu.Unlock()
			return nil, nil, fmt.Errorf("%w: %s", ErrNotFound, id)
		}
		if e.op == nil {
			return e, nil, nil
		}
		cur := e.op
		for _, s := range w.conflict {
			if cur.kind == s {
				o.mu.Unlock()
				return nil, nil, fmt.Errorf("%w: sandbox %s is %s", ErrConflict, id, cur.kind)
			}
		}
		o.mu.Unlock()
		select {
		case <-cur.done:
		case <-ctx.Done():
			return nil, nil, ctx.Err()
		}
		if w.join != "" && cur.kind == w.join {
			return nil, cur, nil
		}
	}
}

// begin starts a transition on a stable entry; o.mu must be held and is released.
func (o *Orchestrator) begin(e *entry, kind State) (*op, State) {
	prev := e.rec.State
	p := &op{kind: kind, done: make(chan struct{})}
	e.op = p
	e.rec.State = kind
	o.mu.Unlock()
	return p, prev
}

// finish ends a transition in state to and returns a copy of the resulting record.
func (o *Orchestrator) finish(e *entry, p *op, to State, err error) *Sandbox {
	o.mu.Lock()
	defer o.mu.Unlock()
	e.rec.State = to
	e.op = nil
	p.err = err
	close(p.done)
	return e.clone()
}

// remove ends a transition by deleting the sandbox from the catalog and memory. The
// record goes first, so once the sandbox is invisible it is also gone from disk.
func (o *Orchestrator) remove(e *entry, p *op, err error) {
	e.pmu.Lock()
	o.mu.Lock()
	id := e.rec.ID
	e.gone = true
	if e.timer != nil {
		e.timer.Stop()
		e.timer = nil
	}
	o.mu.Unlock()
	if derr := o.records.Delete(id); derr != nil {
		// The record would come back at restart; Start drops records without an
		// instance, so this only delays cleanup.
		o.log.Error("delete sandbox record", "sandbox", id, "err", derr)
	}
	e.pmu.Unlock()
	// Before the operation completes, so a caller that saw the kill finish sees the
	// layers released too.
	o.unpin(id)
	if lerr := o.logs.drop(id); lerr != nil {
		o.log.Warn("delete sandbox logs", "sandbox", id, "err", lerr)
	}
	o.mu.Lock()
	if o.entries[id] == e {
		delete(o.entries, id)
	}
	e.op = nil
	p.err = err
	close(p.done)
	o.mu.Unlock()
}

// persist writes the entry's current record, unless it was removed meanwhile.
func (o *Orchestrator) persist(e *entry) error {
	e.pmu.Lock()
	defer e.pmu.Unlock()
	o.mu.Lock()
	if e.gone {
		o.mu.Unlock()
		return nil
	}
	rec := e.clone()
	if rec.State != StatePaused {
		// Transitional states are never stored: a crash mid-transition is settled by
		// Start from the last stable state and what the backend still has.
		rec.State = StateRunning
	}
	o.mu.Unlock()
	raw, err := encodeRecord(rec)
	if err != nil {
		return err
	}
	if err := o.records.Put(rec.ID, raw); err != nil {
		return fmt.Errorf("persist sandbox %s: %w", rec.ID, err)
	}
	return nil
}

// opContext detaches an operation from its caller: a client hanging up must not
// abandon a sandbox halfway through a transition.
func (o *Orchestrator) opContext(ctx context.Context) (context.Context, context.CancelFunc) {
	return context.WithTimeout(context.WithoutCancel(ctx), o.cfg.OperationTimeout)
}

// validTimeout turns a requested TTL into an effective one.
func (o *Orchestrator) validTimeout(d time.Duration) (time.Duration, error) {
	switch {
	case d < 0:
		return 0, fmt.Errorf("%w: timeout must not be negative", ErrInvalid)
	case d == 0:
		return o.cfg.DefaultTimeout, nil
	case d > o.cfg.MaxTimeout:
		return 0, fmt.Errorf("%w: timeout %s exceeds the maximum of %s", ErrInvalid, d, o.cfg.MaxTimeout)
	}
	return d, nil
}
