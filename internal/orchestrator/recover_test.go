package orchestrator

import (
	"context"
	"errors"
	"slices"
	"testing"
	"time"

	"github.com/aenv-dev/aenv/internal/sandbox"
	"github.com/aenv-dev/aenv/internal/sandbox/mock"
)

func TestRestartReconciles(t *testing.T) {
	ctx := context.Background()
	for _, mode := range backendModes {
		t.Run(mode.name, func(t *testing.T) {
			h := newHarness(t, mode.opts, nil)
			survivor := h.create(CreateRequest{Timeout: time.Minute, Secure: true, Metadata: map[string]string{"k": "v"}})
			died := h.create(CreateRequest{Timeout: time.Minute})
			paused := h.create(CreateRequest{Secure: true})
			if err := h.o.Pause(ctx, paused.ID, sandbox.PauseOptions{}); err != nil {
				t.Fatal(err)
			}
			// An instance no record knows (a crash between launch and persist).
			if _, err := h.b.Launch(ctx, sandbox.LaunchPlan{SandboxID: "orphan0000000000000a"}); err != nil {
				t.Fatal(err)
			}
			h.b.Vanish(died.ID)

			h.restart()

			if !slices.Contains(h.b.Removed(), "orphan0000000000000a") || h.b.Instance("orphan0000000000000a") != nil {
				t.Fatalf("orphan not reconciled away: removed=%v", h.b.Removed())
			}
			if _, err := h.o.Get(ctx, died.ID); !errors.Is(err, ErrNotFound) {
				t.Fatalf("dead sandbox still known: %v", err)
			}
			if h.stored(died.ID) != nil {
				t.Fatal("dead sandbox's record kept")
			}
			got, err := h.o.Get(ctx, survivor.ID)
			if err != nil || got.State != StateRunning || got.Metadata["k"] != "v" || !got.EndAt.Equal(survivor.EndAt) {
				t.Fatalf("survivor %+v %v", got, err)
			}
			if got, err := h.o.Get(ctx, paused.ID); err != nil || got.State != StatePaused {
				t.Fatalf("paused after restart %+v %v", got, err)
			}

			// The survivor's TTL is armed again.
			h.clock.Advance(time.Minute)
			h.settle()
			if _, err := h.o.Get(ctx, survivor.ID); !errors.Is(err, ErrNotFound) {
				t.Fatal("survivor's TTL not re-armed after restart")
			}

			// The paused one resumes with its id and token (the seed was persisted).
			sb, resumed, err := h.o.Connect(ctx, paused.ID, ConnectOptions{})
			if err != nil || !resumed || sb.EnvdAccessToken != paused.EnvdAccessToken {
				t.Fatalf("resume after restart %+v resumed=%v err=%v", sb, resumed, err)
			}
		})
	}
}

func TestRestartDropsUndecodablePausedState(t *testing.T) {
	ctx := context.Background()
	h := newHarness(t, backendModes[1].opts, nil)
	sb := h.create(CreateRequest{})
	if err := h.o.Pause(ctx, sb.ID, sandbox.PauseOptions{}); err != nil {
		t.Fatal(err)
	}
	h.b.Fail(mock.StageDecode, errors.New("incompatible"), 1)
	h.restart()
	if _, err := h.o.Get(ctx, sb.ID); !errors.Is(err, ErrNotFound) {
		t.Fatalf("undecodable paused sandbox kept: %v", err)
	}
	if h.stored(sb.ID) != nil {
		t.Fatal("record kept")
	}
}

func TestRestartExpiresElapsedTTL(t *testing.T) {
	h := newHarness(t, backendModes[0].opts, nil)
	sb := h.create(CreateRequest{Timeout: time.Minute})
	h.o.mu.Lock()
	h.o.closing = true // the node is down: its timers must not fire
	h.o.mu.Unlock()
	h.clock.Advance(2 * time.Minute)
	h.restart()
	eventually(t, "elapsed TTL to expire after restart", func() bool { return h.state(sb.ID) == "" })
}

func TestReconcileFailureFailsStart(t *testing.T) {
	h := newHarness(t, backendModes[0].opts, nil)
	h.b.Fail(mock.StageReconcile, errors.New("runtime unavailable"), 1)
	o, err := New(Config{Logger: quietLogger}, h.b, h.cat)
	if err != nil {
		t.Fatal(err)
	}
	if err := o.Start(context.Background()); err == nil {
		t.Fatal("Start succeeded though reconcile failed")
	}
}

func TestShutdown(t *testing.T) {
	ctx := context.Background()
	cases := []struct {
		action   ShutdownAction
		mode     mock.Options
		wantRun  State // the running sandbox after restart
		wantLive bool
	}{
		{ShutdownPause, backendModes[0].opts, StatePaused, true},
		{ShutdownPause, backendModes[1].opts, StatePaused, false},
		{ShutdownStop, backendModes[0].opts, "", false},
		{ShutdownKeep, backendModes[0].opts, StateRunning, true},
	}
	for _, tc := range cases {
		t.Run(string(tc.action), func(t *testing.T) {
			h := newHarness(t, tc.mode, func(c *Config) { c.ShutdownAction = tc.action })
			run := h.create(CreateRequest{Timeout: time.Hour})
			paused := h.create(CreateRequest{})
			if err := h.o.Pause(ctx, paused.ID, sandbox.PauseOptions{}); err != nil {
				t.Fatal(err)
			}
			if err := h.o.Shutdown(ctx); err != nil {
				t.Fatal(err)
			}
			if _, err := h.o.Create(ctx, CreateRequest{TemplateID: "base"}); !errors.Is(err, ErrCapacity) {
				t.Fatalf("create after shutdown: %v", err)
			}
			if (h.b.Instance(run.ID) != nil) != tc.wantLive {
				t.Fatalf("instance live=%v, want %v", h.b.Instance(run.ID) != nil, tc.wantLive)
			}
			h.restart()
			if got := h.state(run.ID); got != tc.wantRun {
				t.Fatalf("after restart %q, want %q", got, tc.wantRun)
			}
			if got := h.state(paused.ID); got != StatePaused {
				t.Fatalf("paused sandbox after restart %q", got)
			}
		})
	}
}

func TestShutdownWaitsForOperations(t *testing.T) {
	h := newHarness(t, backendModes[0].opts, func(c *Config) { c.ShutdownAction = ShutdownStop })
	sb := h.create(CreateRequest{})
	bl := block(h.b, mock.StagePause)
	paused := make(chan error, 1)
	go func() { paused <- h.o.Pause(context.Background(), sb.ID, sandbox.PauseOptions{}) }()
	<-bl.entered
	done := make(chan error, 1)
	go func() { done <- h.o.Shutdown(context.Background()) }()
	select {
	case err := <-done:
		t.Fatalf("shutdown returned (%v) while a pause was in flight", err)
	case <-time.After(20 * time.Millisecond):
	}
	close(bl.release)
	if err := <-paused; err != nil {
		t.Fatal(err)
	}
	if err := <-done; err != nil {
		t.Fatal(err)
	}
	// Shutdown stops running sandboxes only; the one that got paused stays paused.
	if h.state(sb.ID) != StatePaused {
		t.Fatalf("state %q", h.state(sb.ID))
	}
}

// A container paused in place keeps its paused state in the instance; when the instance
// did not survive the restart the record is dropped instead of failing every connect.
func TestRestartDropsInPlacePauseWithoutInstance(t *testing.T) {
	ctx := context.Background()
	h := newHarness(t, backendModes[0].opts, nil)
	sb := h.create(CreateRequest{Secure: true})
	if err := h.o.Pause(ctx, sb.ID, sandbox.PauseOptions{KeepMemory: true}); err != nil {
		t.Fatal(err)
	}
	h.b.Vanish(sb.ID)
	h.restart()
	if _, err := h.o.Get(ctx, sb.ID); !errors.Is(err, ErrNotFound) {
		t.Fatalf("Get after restart = %v, want ErrNotFound", err)
	}
	if _, _, err := h.o.Connect(ctx, sb.ID, ConnectOptions{}); !errors.Is(err, ErrNotFound) {
		t.Fatalf("Connect after restart = %v, want ErrNotFound", err)
	}
	if h.stored(sb.ID) != nil {
		t.Fatal("record of the lost paused sandbox kept")
	}
}

// Without memory snapshots a graceful shutdown pauses to disk (where the backend can
// capture the sandbox), so the sandbox survives a restart that loses its instance.
func TestShutdownPausesToDiskWithoutMemorySnapshots(t *testing.T) {
	ctx := context.Background()
	h := newHarness(t, snapModes[0].opts, nil)
	sb := h.create(CreateRequest{Secure: true, Timeout: time.Minute})
	h.inst(sb.ID).WriteFile("/work/state", []byte("kept"))
	if err := h.o.Shutdown(ctx); err != nil {
		t.Fatal(err)
	}
	if st := h.stored(sb.ID); st == nil || st.State != StatePaused || len(st.DiskSnapshot) == 0 {
		t.Fatalf("persisted after shutdown: %+v", st)
	}
	h.restart()
	got, resumed, err := h.o.Connect(ctx, sb.ID, ConnectOptions{Timeout: time.Minute})
	if err != nil || !resumed || got.EnvdAccessToken != sb.EnvdAccessToken {
		t.Fatalf("connect after restart: %+v resumed=%v err=%v", got, resumed, err)
	}
	if v := h.file(sb.ID, "/work/state"); v != "kept" {
		t.Fatalf("file after resume = %q", v)
	}
}
