package integration

import (
	"context"
	"fmt"
	"net/http"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/aenv-dev/aenv/internal/bench"
)

// BenchmarkLazyLayers measures node B reading an image node A made, with the repository
// local (posix_fs on this host): A writes 1 GiB of random data in a base sandbox and
// snapshots it; then, AENV_LAZY_BENCH_RUNS times (default 5), B is restarted with an
// empty block cache (so it has read nothing of the image) and creates a sandbox from the
// snapshot and runs its first command, then does the same again (its blocks now cached,
// for comparison). Reported: the medians of create → first command answered, cold and
// cached, the median bytes fetched from the repository for that, and the bytes fetched
// by a command that reads the first 50 MiB of the 1 GiB file (after the create of the last
// run). Run it with -bench LazyLayers -run '^$' -benchtime 1x (one iteration does every
// run).
func BenchmarkLazyLayers(b *testing.B) {
	runs := 5
	if v, err := strconv.Atoi(os.Getenv("AENV_LAZY_BENCH_RUNS")); err == nil && v > 0 {
		runs = v
	}
	p := startPair(b)
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Minute)
	defer cancel()
	ca := p.a.client()
	src := p.a.create(ctx, ca)
	run(ctx, b, ca, src, "head -c 1073741824 /dev/urandom > /home/user/big")
	const read50 = "head -c 52428800 /home/user/big | md5sum"
	want := run(ctx, b, ca, src, read50)
	snap := takeSnapshot(ctx, b, p.a, src.ID, "")
	if !waitFor(5*time.Minute, func() bool { return p.b.listsSnapshot(ctx, b, snap) }) {
		b.Fatalf("node B never listed snapshot %s", snap)
	}
	image := imageBytes(ctx, b, p.repo, snap)

	var cold, warm []time.Duration
	var fetched []int64
	var fetched50 int64
	var stages []string
	for range b.N {
		for i := range runs {
			p.b.stop()
			if err := os.RemoveAll(filepath.Join(p.b.dataDir, "block-cache")); err != nil {
				b.Fatal(err)
			}
			p.b.start()
			if !waitFor(time.Minute, func() bool { return p.b.listsSnapshot(ctx, b, snap) }) {
				b.Fatalf("node B does not list snapshot %s after its restart", snap)
			}
			cb := p.b.client()
			before := p.b.metric(ctx, b, "aenv_repository_fetched_bytes_total")
			t0 := time.Now()
			sb, err := cb.Create(ctx, bench.CreateRequest{TemplateID: snap, Timeout: 600, Secure: true})
			if err != nil {
				b.Fatal(err)
			}
			run(ctx, b, cb, sb, "true")
			cold = append(cold, time.Since(t0))
			p.b.observe()
			after := p.b.metric(ctx, b, "aenv_repository_fetched_bytes_total")
			fetched = append(fetched, after-before)
			stages = append(stages, createStages(ctx, b, p.b))
			// The same create again, its blocks now cached: what laziness costs.
			t0 = time.Now()
			again, err := cb.Create(ctx, bench.CreateRequest{TemplateID: snap, Timeout: 600, Secure: true})
			if err != nil {
				b.Fatal(err)
			}
			run(ctx, b, cb, again, "true")
			warm = append(warm, time.Since(t0))
			p.b.observe()
			if i == runs-1 {
				after = p.b.metric(ctx, b, "aenv_repository_fetched_bytes_total")
				if got := run(ctx, b, cb, sb, read50); got != want {
					b.Fatalf("node B reads %q from the first 50 MiB, node A %q", got, want)
				}
				fetched50 = p.b.metric(ctx, b, "aenv_repository_fetched_bytes_total") - after
			}
			killAll(ctx, b, cb)
		}
	}
	slices.Sort(cold)
	slices.Sort(warm)
	slices.Sort(fetched)
	b.Logf("image %d MiB; create → first command on node B, cold (nothing of the image read): %v; the same with its blocks cached: %v",
		image>>20, cold, warm)
	b.Logf("fetched per cold create (bytes): %v; a command reading 50 MiB of the 1 GiB file fetched %.1f MiB", fetched, float64(fetched50)/(1<<20))
	b.Logf("cold create stages (ms, cumulative on each restarted node): %v", stages)
	b.ReportMetric(float64(cold[len(cold)/2].Microseconds())/1000, "ms-cold-first-cmd-p50")
	b.ReportMetric(float64(warm[len(warm)/2].Microseconds())/1000, "ms-cached-first-cmd-p50")
	b.ReportMetric(float64(fetched[len(fetched)/2])/(1<<20), "MiB-fetched-create-p50")
	b.ReportMetric(float64(fetched50)/(1<<20), "MiB-fetched-50MiB-read")
	b.ReportMetric(0, "ns/op")
	killAll(ctx, b, ca)
}

// createStages reads the create stage sums (ms) of a node that made one create so far.
func createStages(ctx context.Context, t testing.TB, n *node) string {
	t.Helper()
	out, err := n.api(ctx, http.MethodGet, "/metrics", "", http.StatusOK)
	if err != nil {
		t.Fatal(err)
	}
	var parts []string
	for line := range strings.SplitSeq(string(out), "\n") {
		rest, ok := strings.CutPrefix(line, `aenv_sandbox_stage_duration_seconds_sum{operation="create",stage="`)
		if !ok {
			continue
		}
		stage, val, _ := strings.Cut(rest, `"`)
		_, num, _ := strings.Cut(val, "} ")
		if f, err := strconv.ParseFloat(num, 64); err == nil {
			parts = append(parts, fmt.Sprintf("%s=%.0f", stage, f*1000))
		}
	}
	return strings.Join(parts, " ")
}
