package microvm

import (
	"context"
	"fmt"
	"os"
	"slices"
	"strconv"
	"testing"
	"time"

	"github.com/aenv-dev/aenv/internal/sandbox"
)

// TestDiskSurvivesReboot writes a file, kills the VM (SIGKILL, no shutdown) and boots a
// new QEMU on the same disk: what the guest synced is there.
func TestDiskSurvivesReboot(t *testing.T) {
	b := newTestBackend(t)
	i := launch(t, b, "sbx-reboot", sandbox.Resources{})
	mustSh(t, i, "echo kept > /root/kept && mkdir -p /home/user/d && echo 2 > /home/user/d/f && sync")
	ctx := context.Background()
	old := i.PID()
	i.mu.Lock()
	proc := i.proc
	i.mu.Unlock()
	if err := proc.kill(ctx); err != nil {
		t.Fatal(err)
	}
	if err := b.startQEMU(ctx, i); err != nil {
		t.Fatal(err)
	}
	if i.PID() == old {
		t.Fatal("same QEMU")
	}
	waitEnvd(t, i)
	if out := mustSh(t, i, "cat /root/kept /home/user/d/f"); out != "kept\n2\n" {
		t.Errorf("after reboot: %q", out)
	}
}

// TestManyBoots boots and stops sandboxes one after another (AENV_MICROVM_BOOTS, default
// 50): without tsc_early_khz about one TCG boot in five hangs in TSC calibration. Each boot
// must reach envd.
func TestManyBoots(t *testing.T) {
	if testing.Short() {
		t.Skip("boots 50 VMs")
	}
	n := 50
	if v, err := strconv.Atoi(os.Getenv("AENV_MICROVM_BOOTS")); err == nil && v > 0 {
		n = v
	}
	b := newTestBackend(t)
	ctx := context.Background()
	var times []time.Duration
	for k := range n {
		t0 := time.Now()
		inst, err := b.Launch(ctx, sandbox.LaunchPlan{Kind: sandbox.LaunchFresh, SandboxID: fmt.Sprintf("boot-%d", k), RootFS: fix.template})
		if err != nil {
			t.Fatal(err)
		}
		i := inst.(*Instance)
		if err := envdReady(i, 2*time.Minute); err != nil {
			console, _ := os.ReadFile(i.ConsoleLog())
			t.Fatalf("boot %d of %d: envd not answering after 2 min (hang?): %v; console:\n%s", k+1, n, err, console)
		}
		times = append(times, time.Since(t0))
		if err := i.Stop(ctx); err != nil {
			t.Fatal(err)
		}
	}
	slices.Sort(times)
	t.Logf("%d boots, launch → envd answering: median %v, min %v, max %v", n,
		times[len(times)/2].Round(time.Millisecond), times[0].Round(time.Millisecond), times[len(times)-1].Round(time.Millisecond))
}

// BenchmarkBootToEnvd is a fresh sandbox's launch until envd answers /health (median in
// median-ms), and its stop.
func BenchmarkBootToEnvd(b *testing.B) {
	be := newTestBackend(b)
	ctx := context.Background()
	var boot, stop []time.Duration
	for k := 0; b.Loop(); k++ {
		t0 := time.Now()
		inst, err := be.Launch(ctx, sandbox.LaunchPlan{Kind: sandbox.LaunchFresh, SandboxID: "bench-" + strconv.Itoa(k), RootFS: fix.template})
		if err != nil {
			b.Fatal(err)
		}
		if err := envdReady(inst.(*Instance), 2*time.Minute); err != nil {
			b.Fatal(err)
		}
		t1 := time.Now()
		if err := inst.Stop(ctx); err != nil {
			b.Fatal(err)
		}
		boot, stop = append(boot, t1.Sub(t0)), append(stop, time.Since(t1))
	}
	b.ReportMetric(median(boot), "boot-median-ms")
	b.ReportMetric(median(stop), "stop-median-ms")
}

func median(d []time.Duration) float64 {
	s := slices.Clone(d)
	slices.Sort(s)
	return float64(s[len(s)/2].Microseconds()) / 1000
}
