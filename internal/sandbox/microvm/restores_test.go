package microvm

import (
	"context"
	"fmt"
	"os"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/aenv-dev/aenv/internal/sandbox"
)

// TestManyRestores restores sandboxes from one memory snapshot one after another
// (AENV_MICROVM_RESTORES, default 50), TestManyBoots' counterpart for restores: each must
// reach envd (a restore that hangs, e.g. in the guest clock after the jump, fails here
// within 2 min) with the snapshot's counter process running, and stop.
func TestManyRestores(t *testing.T) {
	if testing.Short() {
		t.Skip("restores 50 VMs")
	}
	n := 50
	if v, err := strconv.Atoi(os.Getenv("AENV_MICROVM_RESTORES")); err == nil && v > 0 {
		n = v
	}
	b := newTestBackend(t)
	ctx := context.Background()
	src := launch(t, b, "restore-src", sandbox.Resources{CPUCount: 1, MemoryMB: testMemMB})
	pid := strings.TrimSpace(mustSh(t, src, counterScript))
	c, err := src.Snapshot(ctx)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if err := b.DiscardSnapshot(ctx, c); err != nil {
			t.Error(err)
		}
	})
	if err := src.Stop(ctx); err != nil {
		t.Fatal(err)
	}
	var times []time.Duration
	for k := range n {
		t0 := time.Now()
		inst, err := b.Launch(ctx, sandbox.LaunchPlan{Kind: sandbox.LaunchFromSnapshot, SandboxID: fmt.Sprintf("restore-%d", k), Snapshot: c})
		if err != nil {
			t.Fatalf("restore %d of %d: %v", k+1, n, err)
		}
		i := inst.(*Instance)
		if err := envdReady(i, 2*time.Minute); err != nil {
			console, _ := os.ReadFile(i.ConsoleLog())
			t.Fatalf("restore %d of %d: envd not answering after 2 min (hang?): %v; console:\n%s", k+1, n, err, console)
		}
		times = append(times, time.Since(t0))
		if got, running, _ := counterState(t, i); got != pid || !running {
			t.Fatalf("restore %d of %d: counter pid %s (running %v), want %s", k+1, n, got, running, pid)
		}
		if err := i.Stop(ctx); err != nil {
			// A QEMU just killed may hold the disk a moment longer under load.
			t.Logf("stop %s: %v; retrying", i.id, err)
			time.Sleep(500 * time.Millisecond)
			if err := i.Stop(ctx); err != nil {
				t.Fatal(err)
			}
		}
	}
	slices.Sort(times)
	t.Logf("%d restores, launch → envd answering: median %v, min %v, max %v", n,
		times[len(times)/2].Round(time.Millisecond), times[0].Round(time.Millisecond), times[len(times)-1].Round(time.Millisecond))
}
