package mock

import (
	"context"
	"errors"
	"net/http"
	"strconv"
	"testing"

	"github.com/aenv-dev/aenv/internal/sandbox"
)

func TestFailCountsDown(t *testing.T) {
	b := New(Options{})
	boom := errors.New("boom")
	b.Fail(StageLaunch, boom, 2)
	ctx := context.Background()
	for i := range 2 {
		if _, err := b.Launch(ctx, sandbox.LaunchPlan{SandboxID: "a"}); !errors.Is(err, boom) {
			t.Fatalf("launch %d: %v, want injected error", i, err)
		}
	}
	inst, err := b.Launch(ctx, sandbox.LaunchPlan{SandboxID: "a"})
	if err != nil {
		t.Fatalf("third launch: %v", err)
	}
	if _, err := b.Launch(ctx, sandbox.LaunchPlan{SandboxID: "a"}); err == nil {
		t.Fatal("duplicate id launched")
	}
	ep := inst.Endpoint()
	resp, err := http.Get("http://" + ep.Host + ":" + strconv.Itoa(ep.EnvdPort) + "/health")
	if err != nil || resp.StatusCode != http.StatusNoContent {
		t.Fatalf("fake envd health: %v %v", resp, err)
	}
	resp.Body.Close()
	if err := inst.Stop(ctx); err != nil {
		t.Fatal(err)
	}
	if _, err := http.Get("http://" + ep.Host + ":" + strconv.Itoa(ep.EnvdPort) + "/health"); err == nil {
		t.Fatal("envd still answers after Stop")
	}
	if err := inst.Stop(ctx); err != nil {
		t.Fatalf("Stop is not idempotent: %v", err)
	}
}

func TestPauseModes(t *testing.T) {
	ctx := context.Background()
	for _, stop := range []bool{false, true} {
		b := New(Options{StopOnPause: stop})
		inst, _ := b.Launch(ctx, sandbox.LaunchPlan{SandboxID: "p"})
		ps, err := inst.Pause(ctx, sandbox.PauseOptions{KeepMemory: true})
		if err != nil {
			t.Fatal(err)
		}
		err = inst.Resume(ctx)
		if stop != errors.Is(err, sandbox.ErrGone) {
			t.Fatalf("stopOnPause=%v: resume in place: %v", stop, err)
		}
		if stop {
			raw, _ := ps.Encode()
			dec, err := b.DecodePaused(raw)
			if err != nil {
				t.Fatal(err)
			}
			if _, err := b.Launch(ctx, sandbox.LaunchPlan{Kind: sandbox.LaunchResume, SandboxID: "p", Paused: dec}); err != nil {
				t.Fatalf("relaunch from paused state: %v", err)
			}
			if _, err := b.Launch(ctx, sandbox.LaunchPlan{Kind: sandbox.LaunchResume, SandboxID: "q", Paused: dec}); err == nil {
				t.Fatal("resume with another sandbox's state accepted")
			}
		}
	}
}

func TestReconcileRemovesUnknown(t *testing.T) {
	ctx := context.Background()
	b := New(Options{})
	b.Launch(ctx, sandbox.LaunchPlan{SandboxID: "keep"})
	b.Launch(ctx, sandbox.LaunchPlan{SandboxID: "drop"})
	alive, err := b.Reconcile(ctx, []string{"keep", "gone"})
	if err != nil {
		t.Fatal(err)
	}
	if len(alive) != 1 || alive["keep"] == nil {
		t.Fatalf("alive = %v", alive)
	}
	if live := b.Live(); len(live) != 1 || live[0] != "keep" {
		t.Fatalf("live after reconcile = %v", live)
	}
}
