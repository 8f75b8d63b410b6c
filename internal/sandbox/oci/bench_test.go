package oci

import (
	"context"
	"fmt"
	"golang.org/x/sys/unix"
	"os"
	"path/filepath"
	"sort"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/aenv-dev/aenv/internal/sandbox"
)

// benchEnv is newTestBackend for benchmarks (which have no subtests' *testing.T).
func benchEnv(b *testing.B, realEnvd bool, warm int) *testEnv {
	needRuntime(b)
	var envd string
	if realEnvd {
		if envd = testEnvd(b); envd == "" {
			b.Skip("cmd/envd does not build or does not answer --help yet")
		}
	}
	dataDir := b.TempDir()
	for d := dataDir; d != os.TempDir() && d != "/"; d = filepath.Dir(d) {
		os.Chmod(d, 0o711)
	}
	cfg := Config{
		DataDir: dataDir, EnvdPath: "/bin/busybox", InitArgs: httpdInit,
		CgroupParent: fmt.Sprintf("%s/bench-%d", testCgroup, os.Getpid()),
		Network:      testNetwork(4), WarmContainers: warm,
	}
	if realEnvd {
		cfg.EnvdPath, cfg.InitArgs = envd, nil
	}
	ctx := context.Background()
	be, err := New(ctx, cfg)
	if err != nil {
		b.Fatal(err)
	}
	b.Cleanup(func() {
		be.mu.Lock()
		var insts []*Instance
		for _, i := range be.instances {
			insts = append(insts, i)
		}
		be.mu.Unlock()
		for _, i := range insts {
			i.Stop(ctx)
		}
		be.warm.close(ctx)
		be.pool.Teardown(ctx)
		if be.rt.ns != nil {
			unix.Unmount(be.rt.ns.root, unix.MNT_DETACH)
		}
		for _, d := range cgroupDirs("/"+be.cfg.CgroupParent, be.v2) {
			os.Remove(d)
		}
	})
	if _, err := be.Reconcile(ctx, nil); err != nil {
		b.Fatal(err)
	}
	return &testEnv{b: be, cfg: be.cfg, template: testTemplate(b)}
}

func inits() []struct {
	name string
	real bool
} {
	return []struct {
		name string
		real bool
	}{{"init=busybox", false}, {"init=envd", true}}
}

// BenchmarkLaunchReady measures Launch until the init answers HTTP on the envd port from
// the host (what create pays before envd /init), with a warm network pool.
func BenchmarkLaunchReady(b *testing.B) {
	for _, in := range inits() {
		for _, warm := range []int{-1, 2} {
			b.Run(fmt.Sprintf("%s/warm=%d", in.name, max(warm, 0)), func(b *testing.B) { benchLaunch(b, in.real, warm) })
		}
	}
}

func benchLaunch(b *testing.B, realEnvd bool, warm int) {
	e := benchEnv(b, realEnvd, warm)
	ctx := context.Background()
	var lat []time.Duration
	b.ResetTimer()
	for n := 0; n < b.N; n++ {
		start := time.Now()
		inst, err := e.b.Launch(ctx, sandbox.LaunchPlan{
			Kind: sandbox.LaunchFresh, SandboxID: "bench" + strconv.Itoa(n),
			RootFS: sandbox.RootFS{LowerDir: e.template}, Resources: sandbox.Resources{CPUCount: 1, MemoryMB: 256},
			AllowInternet: true,
		})
		if err != nil {
			b.Fatal(err)
		}
		e.waitReady(b, inst.(*Instance))
		lat = append(lat, time.Since(start))
		b.StopTimer()
		if err := inst.Stop(ctx); err != nil {
			b.Fatal(err)
		}
		// Let the warm pools refill, as between creates (a burst drains them).
		time.Sleep(100 * time.Millisecond)
		b.StartTimer()
	}
	sort.Slice(lat, func(i, j int) bool { return lat[i] < lat[j] })
	b.ReportMetric(float64(lat[len(lat)/2].Microseconds())/1000, "median-ms")
	b.ReportMetric(float64(lat[len(lat)*95/100].Microseconds())/1000, "p95-ms")
}

// BenchmarkIdleMemory launches 10 idle sandboxes and reports the host memory they cost:
// the drop in MemAvailable (includes runtime-side kernel objects, overlay, netns) and the
// sandboxes' own cgroup usage.
func BenchmarkIdleMemory(b *testing.B) {
	const n = 10
	for _, in := range inits() {
		b.Run(in.name, func(b *testing.B) {
			e := benchEnv(b, in.real, -1)
			ctx := context.Background()
			for it := 0; it < b.N; it++ {
				time.Sleep(300 * time.Millisecond)
				before := memAvailable(b)
				var insts []*Instance
				for k := 0; k < n; k++ {
					inst, err := e.b.Launch(ctx, sandbox.LaunchPlan{
						Kind: sandbox.LaunchFresh, SandboxID: fmt.Sprintf("idle%d-%d", it, k),
						RootFS: sandbox.RootFS{LowerDir: e.template}, Resources: sandbox.Resources{CPUCount: 1, MemoryMB: 256},
					})
					if err != nil {
						b.Fatal(err)
					}
					e.waitReady(b, inst.(*Instance))
					insts = append(insts, inst.(*Instance))
				}
				time.Sleep(time.Second)
				after := memAvailable(b)
				var cg int64
				for _, i := range insts {
					st, err := i.Stats(ctx)
					if err != nil {
						b.Fatal(err)
					}
					cg += st.MemUsed
				}
				b.ReportMetric(float64(before-after)/n/(1<<20), "host-MiB/sandbox")
				b.ReportMetric(float64(cg)/n/(1<<20), "cgroup-MiB/sandbox")
				for _, i := range insts {
					i.Stop(ctx)
				}
			}
		})
	}
}

func memAvailable(b *testing.B) int64 {
	raw, err := os.ReadFile("/proc/meminfo")
	if err != nil {
		b.Fatal(err)
	}
	for _, l := range strings.Split(string(raw), "\n") {
		if f := strings.Fields(l); len(f) >= 2 && f[0] == "MemAvailable:" {
			kb, _ := strconv.ParseInt(f[1], 10, 64)
			return kb << 10
		}
	}
	b.Fatal("no MemAvailable")
	return 0
}
