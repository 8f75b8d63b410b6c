package oci

import (
	"context"
	"fmt"
	"sort"
	"strconv"
	"testing"
	"time"

	"github.com/aenv-dev/aenv/internal/sandbox"
)

func reportLatency(b *testing.B, unit string, lat []time.Duration) {
	b.Helper()
	if len(lat) == 0 {
		return
	}
	sort.Slice(lat, func(i, j int) bool { return lat[i] < lat[j] })
	b.ReportMetric(float64(lat[len(lat)/2].Microseconds())/1000, "median-"+unit)
	b.ReportMetric(float64(lat[len(lat)*95/100].Microseconds())/1000, "p95-"+unit)
}

// BenchmarkLaunchRoot compares Launch-until-ready on a layered template (stack, FUSE, loop,
// ext4 mount) with the directory template (overlay), without and with warm containers.
func BenchmarkLaunchRoot(b *testing.B) {
	for _, kind := range []string{"dir", "layered"} {
		for _, warm := range []int{-1, 2} {
			b.Run(fmt.Sprintf("root=%s/warm=%d", kind, max(warm, 0)), func(b *testing.B) { benchLaunchRoot(b, kind, warm) })
		}
	}
}

func benchLaunchRoot(b *testing.B, kind string, warm int) {
	e := benchEnv(b, false, warm)
	fs := sandbox.RootFS{LowerDir: e.template}
	if kind == "layered" {
		fs = testLayered(b)
	}
	ctx := context.Background()
	var lat []time.Duration
	b.ResetTimer()
	for n := 0; n < b.N; n++ {
		start := time.Now()
		inst, err := e.b.Launch(ctx, sandbox.LaunchPlan{Kind: sandbox.LaunchFresh, SandboxID: "lr" + strconv.Itoa(n),
			RootFS: fs, Resources: sandbox.Resources{CPUCount: 1, MemoryMB: 256}, AllowInternet: true})
		if err != nil {
			b.Fatal(err)
		}
		e.waitReady(b, inst.(*Instance))
		lat = append(lat, time.Since(start))
		b.StopTimer()
		if err := inst.Stop(ctx); err != nil {
			b.Fatal(err)
		}
		if warm > 0 {
			time.Sleep(150 * time.Millisecond) // let the pool refill, as between creates
		}
		b.StartTimer()
	}
	reportLatency(b, "ms", lat)
}

// BenchmarkSnapshot measures Instance.Snapshot of a running sandbox right after it wrote
// a given amount of data (not fsynced: the snapshot flushes it): the whole capture and the
// frozen window (freeze, seal and restack, thaw), the 0, 100 MiB and 1 GiB.
func BenchmarkSnapshot(b *testing.B) {
	for _, q := range []string{QuiesceFreeze, QuiesceSync} {
		for _, mb := range []int{0, 100, 1024} {
			b.Run(fmt.Sprintf("quiesce=%s/written=%dMiB", q, mb), func(b *testing.B) { benchSnapshot(b, q, mb) })
		}
	}
}

func benchSnapshot(b *testing.B, q string, mb int) {
	e := benchEnv(b, false, -1)
	e.b.cfg.SnapshotQuiesce = q
	fs := testLayered(b)
	ctx := context.Background()
	inst, err := e.b.Launch(ctx, sandbox.LaunchPlan{Kind: sandbox.LaunchFresh, SandboxID: "snap",
		RootFS: fs, Resources: sandbox.Resources{CPUCount: 1, MemoryMB: 512, DiskSizeMB: 2048}})
	if err != nil {
		b.Fatal(err)
	}
	i := inst.(*Instance)
	e.waitReady(b, i)
	var total, frozen []time.Duration
	b.ResetTimer()
	for n := 0; n < b.N; n++ {
		b.StopTimer()
		if mb > 0 {
			if out, code := e.sh(b, i, fmt.Sprintf("dd if=/dev/zero of=/root/data bs=1M count=%d 2>&1", mb)); code != 0 {
				b.Fatalf("dd: %s", out)
			}
		}
		b.StartTimer()
		start := time.Now()
		c, err := i.Snapshot(ctx)
		if err != nil {
			b.Fatal(err)
		}
		total = append(total, time.Since(start))
		frozen = append(frozen, time.Duration(c.(*Captured).FrozenMicros)*time.Microsecond)
		b.StopTimer()
		if err := e.b.DiscardSnapshot(ctx, c); err != nil {
			b.Fatal(err)
		}
		b.StartTimer()
	}
	reportLatency(b, "total-ms", total)
	reportLatency(b, "frozen-ms", frozen)
}

// BenchmarkFork10 measures Instance.Fork into 10 children until every child's init
// answers from the host.
func BenchmarkFork10(b *testing.B) {
	e := benchEnv(b, false, -1)
	fs := testLayered(b)
	ctx := context.Background()
	inst, err := e.b.Launch(ctx, sandbox.LaunchPlan{Kind: sandbox.LaunchFresh, SandboxID: "fsrc",
		RootFS: fs, Resources: sandbox.Resources{CPUCount: 1, MemoryMB: 256}})
	if err != nil {
		b.Fatal(err)
	}
	src := inst.(*Instance)
	e.waitReady(b, src)
	var lat []time.Duration
	b.ResetTimer()
	for n := 0; n < b.N; n++ {
		specs := make([]sandbox.ForkSpec, 10)
		for k := range specs {
			specs[k] = sandbox.ForkSpec{SandboxID: fmt.Sprintf("fk%d-%d", n, k), Resources: sandbox.Resources{CPUCount: 1, MemoryMB: 128}}
		}
		start := time.Now()
		res, err := src.Fork(ctx, specs)
		if err != nil {
			b.Fatal(err)
		}
		for _, r := range res {
			if r.Err != nil {
				b.Fatal(r.Err)
			}
			e.waitReady(b, r.Instance.(*Instance))
		}
		lat = append(lat, time.Since(start))
		b.StopTimer()
		for _, r := range res {
			if err := r.Instance.Stop(ctx); err != nil {
				b.Fatal(err)
			}
		}
		b.StartTimer()
	}
	reportLatency(b, "ms", lat)
}
