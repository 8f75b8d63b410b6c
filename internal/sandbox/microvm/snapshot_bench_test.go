package microvm

import (
	"context"
	"fmt"
	"slices"
	"testing"
	"time"

	"github.com/aenv-dev/aenv/internal/sandbox"
)

func medianMS(ds []time.Duration) float64 {
	if len(ds) == 0 {
		return 0
	}
	s := slices.Clone(ds)
	slices.Sort(s)
	return float64(s[len(s)/2].Microseconds()) / 1000
}

// BenchmarkRestoreFromSnapshot: one capture of a booted sandbox, then per iteration a
// launch from it (network slot, disk on the sealed layers, tap, QEMU restored on a
// private mapping of the RAM file, cont) until envd answers /health on the slot address.
// launch-ms is Launch returning (the VM runs), envd-ms envd answering.
func BenchmarkRestoreFromSnapshot(b *testing.B) {
	be := newSnapshotBackend(b)
	ctx := context.Background()
	src := launch(b, be, "sbx-bsrc", sandbox.Resources{CPUCount: 1, MemoryMB: testMemMB, DiskSizeMB: templateMB})
	c, err := src.Snapshot(ctx)
	if err != nil {
		b.Fatal(err)
	}
	defer be.DiscardSnapshot(ctx, c)
	if err := src.Stop(ctx); err != nil {
		b.Fatal(err)
	}
	var launchT, envdT []time.Duration
	n := 0
	for b.Loop() {
		t0 := time.Now()
		inst, err := be.Launch(ctx, sandbox.LaunchPlan{Kind: sandbox.LaunchFromSnapshot, SandboxID: fmt.Sprintf("sbx-b%d", n), Snapshot: c})
		if err != nil {
			b.Fatal(err)
		}
		n++
		launchT = append(launchT, time.Since(t0))
		if err := envdReady(inst.(*Instance), 60*time.Second); err != nil {
			b.Fatal(err)
		}
		envdT = append(envdT, time.Since(t0))
		stopRetry(b, inst)
	}
	b.ReportMetric(medianMS(launchT), "launch-ms")
	b.ReportMetric(medianMS(envdT), "envd-ms")
}

// BenchmarkSnapshotAndPause: a live snapshot of a running sandbox (stop, device state,
// disk seal, RAM file copy, cont) and, separately, a pause (no RAM copy, VM ended) with
// the resume that follows it.
func BenchmarkSnapshotAndPause(b *testing.B) {
	be := newSnapshotBackend(b)
	ctx := context.Background()
	id := "sbx-bsnap"
	i := launch(b, be, id, sandbox.Resources{CPUCount: 1, MemoryMB: testMemMB, DiskSizeMB: templateMB})
	var snapT, pauseT, resumeT []time.Duration
	for b.Loop() {
		t0 := time.Now()
		c, err := i.Snapshot(ctx)
		if err != nil {
			b.Fatal(err)
		}
		snapT = append(snapT, time.Since(t0))
		be.DiscardSnapshot(ctx, c)
		t1 := time.Now()
		ps, err := i.Pause(ctx, sandbox.PauseOptions{KeepMemory: true})
		if err != nil {
			b.Fatal(err)
		}
		pauseT = append(pauseT, time.Since(t1))
		t2 := time.Now()
		inst, err := be.Launch(ctx, sandbox.LaunchPlan{Kind: sandbox.LaunchResume, SandboxID: id, Paused: ps})
		if err != nil {
			b.Fatal(err)
		}
		i = inst.(*Instance)
		if err := envdReady(i, 60*time.Second); err != nil {
			b.Fatal(err)
		}
		resumeT = append(resumeT, time.Since(t2))
	}
	b.ReportMetric(medianMS(snapT), "snapshot-ms")
	b.ReportMetric(medianMS(pauseT), "pause-ms")
	b.ReportMetric(medianMS(resumeT), "resume-envd-ms")
}

// stopRetry stops an instance, once more after an error: the FUSE server may not have
// seen the killed QEMU's file release yet when the disk is unmounted.
func stopRetry(b *testing.B, inst sandbox.Instance) {
	ctx := context.Background()
	if err := inst.Stop(ctx); err != nil {
		b.Logf("stop %s: %v; retrying", inst.ID(), err)
		time.Sleep(500 * time.Millisecond)
		if err := inst.Stop(ctx); err != nil {
			b.Fatal(err)
		}
	}
}
