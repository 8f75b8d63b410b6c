package snapshot

import (
	"context"
	"math/rand/v2"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"testing"
	"time"
)

// BenchmarkPublish64MiB measures Publish → complete for one new 64 MiB
// layer (hash, copy into the node cache, pending record, upload, check,
// complete) on each backend; it reports the median per publication.
//
//	go test ./internal/snapshot -run '^$' -bench Publish64MiB -benchtime 5x
func BenchmarkPublish64MiB(b *testing.B) {
	const size = 64 << 20
	for _, be := range backends() {
		b.Run(be.name, func(b *testing.B) {
			ctx := context.Background()
			n := newNode(b, "node-a", be.open(b), Options{})
			dir := b.TempDir()
			buf := make([]byte, size)
			rng := rand.New(rand.NewPCG(1, 2))
			var times []time.Duration
			b.SetBytes(size)
			b.ResetTimer()
			for i := 0; b.Loop(); i++ {
				b.StopTimer()
				for j := 0; j < len(buf); j += 8 {
					v := rng.Uint64()
					for k := range 8 {
						buf[j+k] = byte(v >> (8 * k))
					}
				}
				path := filepath.Join(dir, "layer-"+strconv.Itoa(i)+".commit")
				if err := os.WriteFile(path, buf, 0o644); err != nil {
					b.Fatal(err)
				}
				m := Manifest{ID: "bench-" + strconv.Itoa(i), Kind: "snapshot", Layers: []LayerFile{{Path: path, UUID: "U" + strconv.Itoa(i)}}}
				b.StartTimer()
				start := time.Now()
				h, err := n.pub.Publish(ctx, m)
				if err != nil {
					b.Fatal(err)
				}
				if err := h.Wait(ctx); err != nil {
					b.Fatal(err)
				}
				times = append(times, time.Since(start))
			}
			slices.Sort(times)
			b.ReportMetric(float64(times[len(times)/2].Milliseconds()), "median-ms")
		})
	}
}
