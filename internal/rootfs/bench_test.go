package rootfs

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"sort"
	"sync/atomic"
	"testing"
	"time"

	"github.com/aenv-dev/aenv/internal/storage/stack"
)

// BenchmarkSnapshotStall measures what a workload sees during Snapshot: a writer appends
// 4 KiB blocks (no fsync) in a loop, and the longest single write during each snapshot
// is the time the root was unavailable to it (baseline-stall: the worst write in 300 ms
// without a snapshot). Snapshots are a second apart, as in use
// (back-to-back freezes are cheaper: the kernel's RCU sync stays warm).
func BenchmarkSnapshotStall(b *testing.B) {
	for _, q := range []struct {
		name string
		q    Quiesce
	}{{"freeze", QuiesceFreeze}, {"sync", QuiesceSync}} {
		b.Run("quiesce="+q.name, func(b *testing.B) {
			needBlock(b)
			dir := b.TempDir()
			base := baseLayer(b, dir, 512, map[string]string{"f": "x"})
			mnt := filepath.Join(dir, "s", "root")
			blk := open(b, Spec{Dir: filepath.Join(dir, "s"), Lowers: []stack.LayerRef{base}, Target: mnt})
			f, err := os.Create(filepath.Join(mnt, "log"))
			if err != nil {
				b.Fatal(err)
			}
			defer f.Close()
			var worst atomic.Int64
			stop := make(chan struct{})
			done := make(chan struct{})
			go func() {
				defer close(done)
				buf := make([]byte, 4096)
				for n := 0; ; n++ {
					select {
					case <-stop:
						return
					default:
					}
					if n%25600 == 0 { // keep the file under 100 MiB
						f.Seek(0, 0)
					}
					t0 := time.Now()
					if _, err := f.Write(buf); err != nil {
						return
					}
					if d := int64(time.Since(t0)); d > worst.Load() {
						worst.Store(d)
					}
				}
			}()
			var stalls, totals, frozen, freeze, idle []time.Duration
			b.ResetTimer()
			for n := 0; n < b.N; n++ {
				b.StopTimer()
				time.Sleep(700 * time.Millisecond)
				// Baseline: the worst write in 300 ms without a snapshot (writeback
				// throttling, a noisy host).
				worst.Store(0)
				time.Sleep(300 * time.Millisecond)
				idle = append(idle, time.Duration(worst.Load()))
				worst.Store(0)
				b.StartTimer()
				_, t, err := blk.Snapshot(context.Background(), filepath.Join(dir, "layers", fmt.Sprint(n)), q.q)
				if err != nil {
					b.Fatal(err)
				}
				stalls = append(stalls, time.Duration(worst.Load()))
				totals = append(totals, t.Total)
				frozen = append(frozen, t.Frozen)
				freeze = append(freeze, t.Freeze)
			}
			b.StopTimer()
			close(stop)
			<-done
			for _, s := range []struct {
				unit string
				d    []time.Duration
			}{{"stall-ms", stalls}, {"baseline-stall-ms", idle}, {"frozen-ms", frozen}, {"freeze-ms", freeze}, {"total-ms", totals}} {
				sort.Slice(s.d, func(i, j int) bool { return s.d[i] < s.d[j] })
				b.ReportMetric(float64(s.d[len(s.d)/2].Microseconds())/1000, "median-"+s.unit)
				b.ReportMetric(float64(s.d[len(s.d)*9/10].Microseconds())/1000, "p90-"+s.unit)
			}
		})
	}
}

// BenchmarkSnapshotAfterWrites measures Snapshot right after the root wrote 0, 100 MiB or
// 1 GiB (buffered writes, no fsync: the snapshot has to make them consistent), in each
// quiesce mode: the time the root was unavailable (frozen) and the whole call (total),
// with the stages inside.
func BenchmarkSnapshotAfterWrites(b *testing.B) {
	for _, q := range []struct {
		name string
		q    Quiesce
	}{{"freeze", QuiesceFreeze}, {"sync", QuiesceSync}} {
		for _, mb := range []int{0, 100, 1024} {
			b.Run(fmt.Sprintf("quiesce=%s/written=%dMiB", q.name, mb), func(b *testing.B) { benchSnapshotAfterWrites(b, q.q, mb) })
		}
	}
}

func benchSnapshotAfterWrites(b *testing.B, q Quiesce, mb int) {
	needBlock(b)
	dir := b.TempDir()
	base := baseLayer(b, dir, 64, map[string]string{"f": "x"})
	mnt := filepath.Join(dir, "s", "root")
	blk := open(b, Spec{Dir: filepath.Join(dir, "s"), Lowers: []stack.LayerRef{base}, VirtualSize: 1536 << 20, Target: mnt})
	chunk := make([]byte, 1<<20)
	for i := range chunk {
		chunk[i] = byte(i * 7)
	}
	var times []SnapshotTimes
	var rates []float64
	b.ResetTimer()
	for n := 0; n < b.N; n++ {
		b.StopTimer()
		if mb > 0 {
			w0 := time.Now()
			f, err := os.Create(filepath.Join(mnt, "data"))
			if err != nil {
				b.Fatal(err)
			}
			for range mb {
				if _, err := f.Write(chunk); err != nil {
					b.Fatal(err)
				}
			}
			if err := f.Close(); err != nil {
				b.Fatal(err)
			}
			rates = append(rates, float64(mb)/time.Since(w0).Seconds())
		}
		b.StartTimer()
		_, t, err := blk.Snapshot(context.Background(), filepath.Join(dir, "layers", fmt.Sprint(n)), q)
		if err != nil {
			b.Fatal(err)
		}
		times = append(times, t)
		b.StopTimer()
		// Keep the host disk from filling: the sealed layers are not needed (the stack
		// keeps its open handle of each).
		os.Remove(filepath.Join(dir, "layers", fmt.Sprint(n)))
		b.StartTimer()
	}
	b.StopTimer()
	if len(rates) > 0 {
		// The writes' own speed: what the flusher and dirty limit cost the workload.
		sort.Float64s(rates)
		b.ReportMetric(rates[len(rates)/2], "median-write-MiB/s")
	}
	for _, s := range []struct {
		unit string
		get  func(SnapshotTimes) time.Duration
	}{
		{"frozen-ms", func(t SnapshotTimes) time.Duration { return t.Frozen }},
		{"total-ms", func(t SnapshotTimes) time.Duration { return t.Total }},
		{"sync-ms", func(t SnapshotTimes) time.Duration { return t.Sync }},
		{"freeze-ms", func(t SnapshotTimes) time.Duration { return t.Freeze }},
		{"seal-ms", func(t SnapshotTimes) time.Duration { return t.Seal }},
		{"thaw-ms", func(t SnapshotTimes) time.Duration { return t.Thaw }},
		{"durable-ms", func(t SnapshotTimes) time.Duration { return t.Durable }},
	} {
		d := make([]time.Duration, len(times))
		for i, t := range times {
			d[i] = s.get(t)
		}
		sort.Slice(d, func(i, j int) bool { return d[i] < d[j] })
		b.ReportMetric(float64(d[len(d)/2].Microseconds())/1000, "median-"+s.unit)
	}
}
