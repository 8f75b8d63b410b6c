package orchestrator

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/aenv-dev/aenv/internal/sandbox"
	"github.com/aenv-dev/aenv/internal/sandbox/mock"
)

// Many goroutines hammer one sandbox with every operation. Whatever interleaving
// happens, each call returns a documented error or success, and at the end memory,
// catalog and backend agree.
func TestConcurrentOperationsOnOneSandbox(t *testing.T) {
	for _, mode := range backendModes {
		t.Run(mode.name, func(t *testing.T) {
			for round := range 4 {
				h := newHarness(t, mode.opts, nil)
				sb := h.create(CreateRequest{Timeout: time.Hour, AutoResume: true, Secure: true})
				ctx := context.Background()
				var unexpected atomic.Value
				check := func(op string, err error) {
					if err == nil || errors.Is(err, ErrNotFound) || errors.Is(err, ErrConflict) || errors.Is(err, ErrNotRunning) {
						return
					}
					unexpected.Store(fmt.Errorf("%s: %w", op, err))
				}
				ops := []func(r *rand.Rand){
					func(*rand.Rand) { check("pause", h.o.Pause(ctx, sb.ID, sandbox.PauseOptions{KeepMemory: true})) },
					func(r *rand.Rand) {
						got, _, err := h.o.Connect(ctx, sb.ID, ConnectOptions{Timeout: time.Duration(1+r.IntN(100)) * time.Minute})
						if err == nil && (got.ID != sb.ID || got.EnvdAccessToken != sb.EnvdAccessToken) {
							unexpected.Store(fmt.Errorf("connect changed identity: %+v", got))
						}
						check("connect", err)
					},
					func(r *rand.Rand) {
						check("timeout", h.o.SetTimeout(ctx, sb.ID, time.Duration(1+r.IntN(100))*time.Minute))
					},
					func(*rand.Rand) { check("refresh", h.o.Refresh(ctx, sb.ID, time.Hour)) },
					func(*rand.Rand) { _, err := h.o.Get(ctx, sb.ID); check("get", err) },
					func(*rand.Rand) { _, _, err := h.o.List(ctx, ListFilter{}); check("list", err) },
					func(*rand.Rand) { _, _, err := h.o.Endpoint(ctx, sb.ID, true); check("endpoint", err) },
					func(*rand.Rand) { _, err := h.o.Metrics(ctx, sb.ID); check("metrics", err) },
				}
				var wg sync.WaitGroup
				for g := range 16 {
					wg.Add(1)
					go func() {
						defer wg.Done()
						r := rand.New(rand.NewPCG(uint64(round), uint64(g)))
						for i := range 30 {
							// One goroutine kills half-way through; the others keep going.
							if g == 0 && i == 15 && round%2 == 0 {
								check("kill", h.o.Kill(ctx, sb.ID))
								continue
							}
							ops[r.IntN(len(ops))](r)
						}
					}()
				}
				wg.Wait()
				if err, _ := unexpected.Load().(error); err != nil {
					t.Fatal(err)
				}
				assertConsistent(t, h, sb.ID)
			}
		})
	}
}

// assertConsistent checks that the orchestrator's view of id matches the catalog and
// the backend.
func assertConsistent(t *testing.T, h *harness, id string) {
	t.Helper()
	h.o.mu.Lock()
	e := h.o.entries[id]
	var st State
	var busy bool
	if e != nil {
		st, busy = e.rec.State, e.op != nil
	}
	h.o.mu.Unlock()
	if busy {
		t.Fatalf("sandbox %s still has an operation in flight", id)
	}
	stored := h.stored(id)
	inst := h.b.Instance(id)
	switch st {
	case "":
		if stored != nil || inst != nil {
			t.Fatalf("killed sandbox left record=%v instance=%v", stored != nil, inst != nil)
		}
	case StateRunning:
		if stored == nil || stored.State != StateRunning || inst == nil || inst.Frozen() {
			t.Fatalf("running sandbox: record=%+v instance=%v", stored, inst)
		}
	case StatePaused:
		if stored == nil || stored.State != StatePaused || (len(stored.Paused) == 0) == (len(stored.DiskSnapshot) == 0) {
			t.Fatalf("paused sandbox: record=%+v", stored)
		}
		if len(stored.DiskSnapshot) > 0 && inst != nil {
			t.Fatal("sandbox paused to disk still has an instance")
		}
		if inst != nil && !inst.Frozen() {
			t.Fatal("paused sandbox has a running instance")
		}
	default:
		t.Fatalf("sandbox left in transitional state %q", st)
	}
}

func TestConcurrentPausesJoin(t *testing.T) {
	h := newHarness(t, backendModes[0].opts, nil)
	sb := h.create(CreateRequest{})
	var pauses atomic.Int32
	bl := &blocker{stage: mock.StagePause, entered: make(chan struct{}), release: make(chan struct{})}
	h.b.SetHook(func(s mock.Stage, id string) error {
		if s == mock.StagePause {
			pauses.Add(1)
			bl.once.Do(func() { close(bl.entered) })
			<-bl.release
		}
		return nil
	})
	ctx := context.Background()
	errs := make(chan error, 2)
	go func() { errs <- h.o.Pause(ctx, sb.ID, sandbox.PauseOptions{}) }()
	<-bl.entered
	go func() { errs <- h.o.Pause(ctx, sb.ID, sandbox.PauseOptions{}) }()
	// The second pause must be waiting on the first, not running its own.
	waitForWaiter(t, h, sb.ID)
	if got := h.state(sb.ID); got != StatePausing {
		t.Fatalf("state mid-pause %q", got)
	}
	close(bl.release)
	for range 2 {
		if err := <-errs; err != nil {
			t.Fatalf("joined pause: %v", err)
		}
	}
	if n := pauses.Load(); n != 1 {
		t.Fatalf("backend paused %d times", n)
	}
}

// waitForWaiter gives a goroutine that is about to block on an op time to do so. The
// outcome does not depend on it: it only makes the interleaving under test likely.
func waitForWaiter(t *testing.T, h *harness, id string) {
	t.Helper()
	time.Sleep(20 * time.Millisecond)
}

func TestConnectWhileKilling(t *testing.T) {
	h := newHarness(t, backendModes[0].opts, nil)
	sb := h.create(CreateRequest{AutoResume: true})
	bl := block(h.b, mock.StageStop)
	ctx := context.Background()
	killed := make(chan error, 1)
	go func() { killed <- h.o.Kill(ctx, sb.ID) }()
	<-bl.entered
	if _, _, err := h.o.Connect(ctx, sb.ID, ConnectOptions{}); !errors.Is(err, ErrConflict) {
		t.Fatalf("connect while killing: %v, want ErrConflict", err)
	}
	if _, _, err := h.o.Endpoint(ctx, sb.ID, true); !errors.Is(err, ErrNotRunning) {
		t.Fatalf("endpoint while killing: %v, want ErrNotRunning", err)
	}
	if err := h.o.Pause(ctx, sb.ID, sandbox.PauseOptions{}); !errors.Is(err, ErrConflict) {
		t.Fatalf("pause while killing: %v, want ErrConflict", err)
	}
	second := make(chan error, 1)
	go func() { second <- h.o.Kill(ctx, sb.ID) }() // joins
	waitForWaiter(t, h, sb.ID)                     // released first, it found the sandbox gone (CI)
	close(bl.release)
	if err := <-killed; err != nil {
		t.Fatal(err)
	}
	if err := <-second; err != nil {
		t.Fatalf("joined kill: %v", err)
	}
}

func TestOperationsWaitForCreate(t *testing.T) {
	h := newHarness(t, backendModes[0].opts, nil)
	bl := block(h.b, mock.StageEnvdInit)
	ctx := context.Background()
	created := make(chan *Sandbox, 1)
	go func() {
		sb, err := h.o.Create(ctx, CreateRequest{TemplateID: "base"})
		if err != nil {
			t.Error(err)
		}
		created <- sb
	}()
	<-bl.entered
	h.o.mu.Lock()
	var id string
	for k := range h.o.entries {
		id = k
	}
	h.o.mu.Unlock()
	if _, err := h.o.Get(ctx, id); !errors.Is(err, ErrNotFound) {
		t.Fatalf("sandbox visible while creating: %v", err)
	}
	if items, _, _ := h.o.List(ctx, ListFilter{}); len(items) != 0 {
		t.Fatal("creating sandbox listed")
	}
	paused := make(chan error, 1)
	go func() { paused <- h.o.Pause(ctx, id, sandbox.PauseOptions{}) }()
	waitForWaiter(t, h, id)
	close(bl.release)
	sb := <-created
	if err := <-paused; err != nil {
		t.Fatalf("pause queued behind create: %v", err)
	}
	if sb.ID != id || h.state(id) != StatePaused {
		t.Fatalf("state %q", h.state(id))
	}
}

// A caller whose context ends while waiting gets its error; the operation it waited
// for still completes.
func TestWaiterContextCancel(t *testing.T) {
	h := newHarness(t, backendModes[0].opts, nil)
	sb := h.create(CreateRequest{})
	bl := block(h.b, mock.StagePause)
	go h.o.Pause(context.Background(), sb.ID, sandbox.PauseOptions{})
	<-bl.entered
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Millisecond)
	defer cancel()
	if err := h.o.SetTimeout(ctx, sb.ID, time.Minute); !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("waiter: %v", err)
	}
	close(bl.release)
	eventually(t, "pause to finish", func() bool { return h.state(sb.ID) == StatePaused })
}

// Many creates and kills in parallel across sandboxes.
func TestParallelCreateKill(t *testing.T) {
	h := newHarness(t, backendModes[1].opts, nil)
	ctx := context.Background()
	var wg sync.WaitGroup
	errs := make(chan error, 64)
	for range 32 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			sb, err := h.o.Create(ctx, CreateRequest{TemplateID: "base"})
			if err != nil {
				errs <- err
				return
			}
			if err := h.o.Pause(ctx, sb.ID, sandbox.PauseOptions{}); err != nil {
				errs <- err
			}
			if err := h.o.Kill(ctx, sb.ID); err != nil {
				errs <- err
			}
		}()
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Error(err)
	}
	all, _ := h.cat.Sandboxes().All()
	if len(all) != 0 || len(h.b.Live()) != 0 || len(h.b.Artifacts()) != 0 {
		t.Fatalf("leftovers: records=%d live=%v artifacts=%v", len(all), h.b.Live(), h.b.Artifacts())
	}
}
