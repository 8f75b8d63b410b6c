package orchestrator

import (
	"context"
	"errors"
	"io"
	"log/slog"
	"path/filepath"
	"sort"
	"sync"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/aenv-dev/aenv/internal/catalog"
	"github.com/aenv-dev/aenv/internal/sandbox"
	"github.com/aenv-dev/aenv/internal/sandbox/mock"
)

// fakeClock fires timers when advanced. Timers due immediately fire on their own
// goroutine, as time.AfterFunc does, because they are armed with o.mu held.
type fakeClock struct {
	mu     sync.Mutex
	now    time.Time
	timers []*fakeTimer
}

type fakeTimer struct {
	c       *fakeClock
	at      time.Time
	f       func()
	stopped bool
}

func newFakeClock() *fakeClock {
	return &fakeClock{now: time.Date(2026, 3, 1, 12, 0, 0, 0, time.UTC)}
}

func (c *fakeClock) Now() time.Time {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.now
}

func (c *fakeClock) AfterFunc(d time.Duration, f func()) Stopper {
	c.mu.Lock()
	defer c.mu.Unlock()
	t := &fakeTimer{c: c, at: c.now.Add(d), f: f}
	if d <= 0 {
		t.stopped = true
		go f()
		return t
	}
	c.timers = append(c.timers, t)
	return t
}

func (t *fakeTimer) Stop() bool {
	t.c.mu.Lock()
	defer t.c.mu.Unlock()
	was := !t.stopped
	t.stopped = true
	return was
}

// Advance moves time forward and runs the timers that became due, in order.
func (c *fakeClock) Advance(d time.Duration) {
	c.mu.Lock()
	c.now = c.now.Add(d)
	var due []*fakeTimer
	keep := c.timers[:0]
	for _, t := range c.timers {
		switch {
		case t.stopped:
		case !t.at.After(c.now):
			t.stopped = true
			due = append(due, t)
		default:
			keep = append(keep, t)
		}
	}
	c.timers = keep
	c.mu.Unlock()
	sort.Slice(due, func(i, j int) bool { return due[i].at.Before(due[j].at) })
	for _, t := range due {
		t.f()
	}
}

// flakyStore wraps the catalog's sandbox store and fails writes on demand.
type flakyStore struct {
	recordStore
	mu      sync.Mutex
	failPut int // number of Puts to fail (-1: all)
}

func (s *flakyStore) Put(id string, rec []byte) error {
	s.mu.Lock()
	fail := s.failPut != 0
	if s.failPut > 0 {
		s.failPut--
	}
	s.mu.Unlock()
	if fail {
		return errors.New("injected catalog write failure")
	}
	return s.recordStore.Put(id, rec)
}

func (s *flakyStore) failPuts(n int) {
	s.mu.Lock()
	s.failPut = n
	s.mu.Unlock()
}

type harness struct {
	t      testing.TB
	o      *Orchestrator
	b      *mock.Backend
	cat    *catalog.Catalog
	dbPath string
	clock  *fakeClock
	reg    *prometheus.Registry
	store  *flakyStore
	cfg    Config
	opts   []Option // extra options of every (re)start
	// wrap, when set, wraps the mock backend the orchestrator is given (to add an
	// optional interface).
	wrap func(*mock.Backend) sandbox.Backend
}

var quietLogger = slog.New(slog.NewTextHandler(io.Discard, nil))

// newHarness builds an orchestrator on a mock backend and a temp catalog holding a
// "base" template (alias "default").
func newHarness(t testing.TB, mo mock.Options, mutate func(*Config)) *harness {
	t.Helper()
	h := &harness{t: t, b: mock.New(mo), clock: newFakeClock()}
	h.dbPath = filepath.Join(t.TempDir(), "aenv.db")
	cat, err := catalog.Open(h.dbPath)
	if err != nil {
		t.Fatal(err)
	}
	h.cat = cat
	t.Cleanup(func() { h.cat.Close() })
	err = cat.Templates().Put(catalog.Template{ID: "base", Kind: catalog.KindTemplate, Aliases: []string{"default"},
		RootFSDir: "/srv/base", Resources: sandbox.Resources{CPUCount: 1, MemoryMB: 256},
		EnvVars: map[string]string{"FROM_TEMPLATE": "1", "SHARED": "template"}})
	if err != nil {
		t.Fatal(err)
	}
	h.cfg = Config{Logger: quietLogger, EnvdReadyTimeout: 2 * time.Second}
	if mutate != nil {
		mutate(&h.cfg)
	}
	h.start()
	return h
}

// start builds a fresh orchestrator over the harness's backend and catalog.
func (h *harness) start() {
	h.t.Helper()
	h.reg = prometheus.NewRegistry()
	cfg := h.cfg
	cfg.Registerer = h.reg
	var backend sandbox.Backend = h.b
	if h.wrap != nil {
		backend = h.wrap(h.b)
	}
	o, err := New(cfg, backend, h.cat, append([]Option{WithClock(h.clock)}, h.opts...)...)
	if err != nil {
		h.t.Fatal(err)
	}
	h.store = &flakyStore{recordStore: o.records}
	o.records = h.store
	if err := o.Start(context.Background()); err != nil {
		h.t.Fatal(err)
	}
	h.o = o
	h.t.Cleanup(func() {
		o.mu.Lock()
		o.closing = true
		for _, e := range o.entries {
			if e.timer != nil {
				e.timer.Stop()
			}
		}
		o.mu.Unlock()
		o.bg.Wait()
		// The start commands' captures write their last lines before the temp dir goes.
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		if err := o.logs.stopFollowing(ctx); err != nil {
			h.t.Error(err)
		}
	})
}

// restart simulates a node restart: the catalog is closed and reopened and a new
// orchestrator starts over the same backend (whose instances outlive the node).
func (h *harness) restart() {
	h.t.Helper()
	h.o.mu.Lock()
	h.o.closing = true
	h.o.mu.Unlock()
	if err := h.cat.Close(); err != nil {
		h.t.Fatal(err)
	}
	cat, err := catalog.Open(h.dbPath)
	if err != nil {
		h.t.Fatal(err)
	}
	h.cat = cat
	h.start()
}

func (h *harness) create(req CreateRequest) *Sandbox {
	h.t.Helper()
	if req.TemplateID == "" {
		req.TemplateID = "base"
	}
	sb, err := h.o.Create(context.Background(), req)
	if err != nil {
		h.t.Fatalf("Create: %v", err)
	}
	return sb
}

func (h *harness) state(id string) State {
	h.t.Helper()
	sb, err := h.o.Get(context.Background(), id)
	if errors.Is(err, ErrNotFound) {
		return ""
	}
	if err != nil {
		h.t.Fatal(err)
	}
	return sb.State
}

// stored returns the persisted record of id, or nil.
func (h *harness) stored(id string) *Sandbox {
	h.t.Helper()
	raw, err := h.cat.Sandboxes().Get(id)
	if errors.Is(err, catalog.ErrNotFound) {
		return nil
	}
	if err != nil {
		h.t.Fatal(err)
	}
	rec, err := decodeRecord(raw)
	if err != nil {
		h.t.Fatal(err)
	}
	return rec
}

// settle waits for background expiries started by Advance. (Expiries of timers due
// immediately run on their own goroutine; tests wait for those with eventually.)
func (h *harness) settle() {
	h.t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	if err := waitGroup(ctx, &h.o.bg); err != nil {
		h.t.Fatal("background operations did not finish")
	}
}

// eventually polls cond for up to five seconds (for asynchronous expiry paths).
func eventually(t *testing.T, what string, cond func() bool) {
	t.Helper()
	if !waitUntil(5*time.Second, cond) {
		t.Fatalf("timed out waiting for %s", what)
	}
}

// waitUntil polls cond until it holds (true) or d passed (false).
func waitUntil(d time.Duration, cond func() bool) bool {
	deadline := time.Now().Add(d)
	for !cond() {
		if time.Now().After(deadline) {
			return false
		}
		time.Sleep(2 * time.Millisecond)
	}
	return true
}

// blocker holds a mock stage until released, to catch operations mid-flight.
type blocker struct {
	stage   mock.Stage
	entered chan struct{}
	release chan struct{}
	once    sync.Once
}

func block(b *mock.Backend, stage mock.Stage) *blocker {
	bl := &blocker{stage: stage, entered: make(chan struct{}), release: make(chan struct{})}
	b.SetHook(func(s mock.Stage, id string) error {
		if s == stage {
			bl.once.Do(func() { close(bl.entered) })
			<-bl.release
		}
		return nil
	})
	return bl
}
