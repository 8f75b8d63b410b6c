package microvm

import (
	"context"
	"fmt"
	"path/filepath"
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
// launch-ms is Launch returning (the VM runs), envd-ms envd answering, cmd-ms a first
// command done after envd /init (what a create from a snapshot then does; init-ms is the
// /init alone), qemu-cpu-ms the CPU
// time QEMU spent until then (user + system, 10 ms ticks): on a shared, loaded host the
// wall-clock figures stretch with the load, the CPU time much less.
func BenchmarkRestoreFromSnapshot(b *testing.B) {
	be := newBenchBackend(b)
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
	var launchT, envdT, cpuT, cmdT, initT []time.Duration
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
		if ticks, _, err := procUsage(inst.(*Instance).PID()); err == nil {
			cpuT = append(cpuT, time.Duration(ticks)*time.Second/clockTicks)
		}
		initT = append(initT, firstCommand(b, inst.(*Instance)))
		cmdT = append(cmdT, time.Since(t0))
		stopRetry(b, inst)
	}
	b.ReportMetric(medianMS(launchT), "launch-ms")
	b.ReportMetric(medianMS(envdT), "envd-ms")
	b.ReportMetric(medianMS(cpuT), "qemu-cpu-ms")
	b.ReportMetric(medianMS(cmdT), "cmd-ms")
	b.ReportMetric(medianMS(initT), "init-ms")
}

// BenchmarkPooledRestore: create from a snapshot whose pool (Config.SnapshotPool) holds a
// VM restored and warmed ahead: per iteration, once the pool has refilled (not timed), a
// launch from it (take, cont) until envd answers /health.
func BenchmarkPooledRestore(b *testing.B) {
	be := newTestBackend(b, func(c *Config) { c.Network.PoolSize = 0; c.SnapshotPool = 1 })
	ctx := context.Background()
	src := launch(b, be, "sbx-bpsrc", sandbox.Resources{CPUCount: 1, MemoryMB: testMemMB, DiskSizeMB: templateMB})
	c, err := src.Snapshot(ctx)
	if err != nil {
		b.Fatal(err)
	}
	defer be.DiscardSnapshot(ctx, c)
	if err := src.Stop(ctx); err != nil {
		b.Fatal(err)
	}
	cid := c.(*capture).ID
	// The first launch starts the pool.
	first, err := be.Launch(ctx, sandbox.LaunchPlan{Kind: sandbox.LaunchFromSnapshot, SandboxID: "sbx-bp", Snapshot: c, AllowInternet: true})
	if err != nil {
		b.Fatal(err)
	}
	stopRetry(b, first)
	var launchT, envdT, cmdT, initT []time.Duration
	n := 0
	for b.Loop() {
		b.StopTimer()
		poolReady(b, be, cid, 1)
		b.StartTimer()
		t0 := time.Now()
		inst, err := be.Launch(ctx, sandbox.LaunchPlan{Kind: sandbox.LaunchFromSnapshot, SandboxID: fmt.Sprintf("sbx-bp%d", n), Snapshot: c, AllowInternet: true})
		if err != nil {
			b.Fatal(err)
		}
		n++
		launchT = append(launchT, time.Since(t0))
		if err := envdReady(inst.(*Instance), 60*time.Second); err != nil {
			b.Fatal(err)
		}
		envdT = append(envdT, time.Since(t0))
		initT = append(initT, firstCommand(b, inst.(*Instance)))
		cmdT = append(cmdT, time.Since(t0))
		if !pooledDir(filepath.Base(inst.(*Instance).dir)) {
			b.Fatalf("launch %d did not come from the pool", n)
		}
		b.StopTimer()
		stopRetry(b, inst)
		b.StartTimer()
	}
	b.ReportMetric(medianMS(launchT), "launch-ms")
	b.ReportMetric(medianMS(envdT), "envd-ms")
	b.ReportMetric(medianMS(cmdT), "cmd-ms")
	b.ReportMetric(medianMS(initT), "init-ms")
}

// firstCommand does what a create does after envd answers, then runs a first command as
// the E2B SDKs do: envd /init (token, environment, clock), then `/bin/bash -l -c true`
// over Connect JSON. It returns how long /init took.
func firstCommand(b testing.TB, i *Instance) time.Duration {
	d, err := firstCommandErr(i)
	if err != nil {
		b.Fatal(err)
	}
	return d
}

func firstCommandErr(i *Instance) (time.Duration, error) {
	t0 := time.Now()
	if err := initEnvdErr(i, "", "tok-"+i.id, map[string]string{"E2B_SANDBOX_ID": i.id}, time.Now()); err != nil {
		return 0, err
	}
	d := time.Since(t0)
	_, err := sdkCommand(i, "tok-"+i.id, "true")
	return d, err
}

// BenchmarkSnapshotAndPause: a live snapshot of a running sandbox (stop, device state,
// disk seal, RAM file copy, cont) and, separately, a pause (no RAM copy, VM ended) with
// the resume that follows it.
func BenchmarkSnapshotAndPause(b *testing.B) {
	be := newBenchBackend(b)
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
func stopRetry(b testing.TB, inst sandbox.Instance) {
	ctx := context.Background()
	if err := inst.Stop(ctx); err != nil {
		b.Logf("stop %s: %v; retrying", inst.ID(), err)
		time.Sleep(500 * time.Millisecond)
		if err := inst.Stop(ctx); err != nil {
			b.Fatal(err)
		}
	}
}
