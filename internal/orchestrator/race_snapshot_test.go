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

// A kill or pause that arrives while a snapshot is capturing waits for it; the
// snapshot completes and is registered, then the other operation runs.
func TestSnapshotConcurrentWithKillAndPause(t *testing.T) {
	ctx := context.Background()
	for _, other := range []string{"kill", "pause", "pause-to-disk", "fork"} {
		t.Run(other, func(t *testing.T) {
			h := newHarness(t, snapModes[0].opts, nil)
			sb := h.create(CreateRequest{Timeout: time.Hour})
			bl := block(h.b, mock.StageSnapshot)
			snapErr := make(chan error, 1)
			go func() { _, err := h.o.Snapshot(ctx, sb.ID, "s1"); snapErr <- err }()
			<-bl.entered
			if got := h.state(sb.ID); got != StateSnapshotting {
				t.Fatalf("state mid-snapshot %q", got)
			}
			otherErr := make(chan error, 1)
			go func() {
				switch other {
				case "kill":
					otherErr <- h.o.Kill(ctx, sb.ID)
				case "pause":
					otherErr <- h.o.Pause(ctx, sb.ID, sandbox.PauseOptions{KeepMemory: true})
				case "pause-to-disk":
					otherErr <- h.o.Pause(ctx, sb.ID, sandbox.PauseOptions{})
				case "fork":
					_, err := h.o.Fork(ctx, sb.ID, 2, 0)
					otherErr <- err
				}
			}()
			waitForWaiter(t, h, sb.ID)
			h.b.SetHook(nil) // the second capture (fork, pause to disk) must not block
			close(bl.release)
			if err := <-snapErr; err != nil {
				t.Fatalf("snapshot: %v", err)
			}
			if err := <-otherErr; err != nil {
				t.Fatalf("%s after snapshot: %v", other, err)
			}
			if _, err := h.cat.Templates().Resolve("s1"); err != nil {
				t.Fatalf("snapshot not registered: %v", err)
			}
			assertConsistent(t, h, sb.ID)
		})
	}
}

// Snapshot and fork refuse at once (409) while a pause or kill is in flight.
func TestSnapshotAndForkRefusedWhilePausingOrKilling(t *testing.T) {
	ctx := context.Background()
	for _, tc := range []struct {
		stage mock.Stage
		start func(h *harness, id string) error
	}{
		{mock.StagePause, func(h *harness, id string) error {
			return h.o.Pause(ctx, id, sandbox.PauseOptions{KeepMemory: true})
		}},
		{mock.StageStop, func(h *harness, id string) error { return h.o.Kill(ctx, id) }},
	} {
		t.Run(string(tc.stage), func(t *testing.T) {
			h := newHarness(t, snapModes[0].opts, nil)
			sb := h.create(CreateRequest{Timeout: time.Hour})
			bl := block(h.b, tc.stage)
			done := make(chan error, 1)
			go func() { done <- tc.start(h, sb.ID) }()
			<-bl.entered
			if _, err := h.o.Snapshot(ctx, sb.ID, ""); !errors.Is(err, ErrConflict) {
				t.Fatalf("snapshot while %s = %v, want ErrConflict", tc.stage, err)
			}
			if _, err := h.o.Fork(ctx, sb.ID, 1, 0); !errors.Is(err, ErrConflict) {
				t.Fatalf("fork while %s = %v, want ErrConflict", tc.stage, err)
			}
			close(bl.release)
			if err := <-done; err != nil {
				t.Fatal(err)
			}
			assertConsistent(t, h, sb.ID)
		})
	}
}

// Every operation, snapshots and forks included, hammers one sandbox; whatever the
// interleaving, each call returns success or a documented error and memory, catalog
// and backend agree at the end.
func TestConcurrentSnapshotOperations(t *testing.T) {
	for _, mode := range snapModes {
		t.Run(mode.name, func(t *testing.T) {
			for round := range 3 {
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
				var children sync.Map
				ops := []func(r *rand.Rand){
					func(*rand.Rand) { _, err := h.o.Snapshot(ctx, sb.ID, ""); check("snapshot", err) },
					func(*rand.Rand) {
						res, err := h.o.Fork(ctx, sb.ID, 2, time.Hour)
						for _, c := range res {
							if c.Err != nil {
								unexpected.Store(fmt.Errorf("fork child: %w", c.Err))
							} else {
								children.Store(c.Sandbox.ID, true)
							}
						}
						check("fork", err)
					},
					func(r *rand.Rand) {
						check("pause", h.o.Pause(ctx, sb.ID, sandbox.PauseOptions{KeepMemory: r.IntN(2) == 0}))
					},
					func(r *rand.Rand) {
						got, _, err := h.o.Connect(ctx, sb.ID, ConnectOptions{Timeout: time.Hour, ColdBoot: r.IntN(2) == 0})
						if err == nil && (got.ID != sb.ID || got.EnvdAccessToken != sb.EnvdAccessToken) {
							unexpected.Store(fmt.Errorf("connect changed identity: %+v", got))
						}
						check("connect", err)
					},
					func(*rand.Rand) { _, _, err := h.o.Endpoint(ctx, sb.ID, true); check("endpoint", err) },
				}
				var wg sync.WaitGroup
				for g := range 8 {
					wg.Add(1)
					go func() {
						defer wg.Done()
						r := rand.New(rand.NewPCG(uint64(round), uint64(g)))
						for i := range 12 {
							if g == 0 && i == 8 && round == 2 {
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
				children.Range(func(k, _ any) bool {
					assertConsistent(t, h, k.(string))
					return true
				})
			}
		})
	}
}
