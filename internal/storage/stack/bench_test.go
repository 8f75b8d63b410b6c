package stack

import (
	"context"
	"fmt"
	"math/rand/v2"
	"os"
	"path/filepath"
	"testing"
	"time"
)

// benchStack builds a stack whose lower holds size bytes of data and whose
// upper holds a tenth of that, written in 64 KiB pieces.
func benchStack(b *testing.B, size int64) (*Stack, string) {
	b.Helper()
	ctx := context.Background()
	dir := b.TempDir()
	s, err := Open(ctx, &Manifest{Dir: dir, VirtualSize: uint64(size), Upper: &Upper{Data: "u.data", Index: "u.index"}}, Options{})
	if err != nil {
		b.Fatal(err)
	}
	b.Cleanup(func() { s.Close() })
	p := make([]byte, 64<<10)
	for i := range p {
		p[i] = byte(i)
	}
	for off := int64(0); off < size; off += int64(len(p)) {
		s.WriteAt(p, off)
	}
	s.Sync()
	if _, err := s.SealAndRestack(ctx, filepath.Join(dir, "lower")); err != nil {
		b.Fatal(err)
	}
	r := rand.New(rand.NewPCG(1, 1))
	for i := int64(0); i < size/10/int64(len(p)); i++ {
		s.WriteAt(p, r.Int64N(size/int64(len(p)))*int64(len(p)))
	}
	s.Sync()
	return s, dir
}

// BenchmarkRandomRead4K: random 4 KiB reads through the Go API with every
// layer in the page cache.
func BenchmarkRandomRead4K(b *testing.B) {
	const size = 256 << 20
	s, _ := benchStack(b, size)
	buf := make([]byte, 4096)
	r := rand.New(rand.NewPCG(2, 2))
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		s.ReadAt(buf, r.Int64N(size/4096)*4096)
	}
	b.ReportMetric(float64(b.N)/b.Elapsed().Seconds(), "IOPS")
}

// BenchmarkRandomRead4KParallel: the same from concurrent readers.
func BenchmarkRandomRead4KParallel(b *testing.B) {
	const size = 256 << 20
	s, _ := benchStack(b, size)
	b.ResetTimer()
	b.RunParallel(func(pb *testing.PB) {
		buf := make([]byte, 4096)
		r := rand.New(rand.NewPCG(rand.Uint64(), 2))
		for pb.Next() {
			s.ReadAt(buf, r.Int64N(size/4096)*4096)
		}
	})
	b.ReportMetric(float64(b.N)/b.Elapsed().Seconds(), "IOPS")
}

// BenchmarkSealAndRestack: seal-and-restack after N bytes of synced writes
// (64 KiB random-offset writes), to show the cost does not grow with data.
func BenchmarkSealAndRestack(b *testing.B) {
	for _, size := range []int64{64 << 20, 1 << 30} {
		b.Run(fmt.Sprintf("written=%dMiB", size>>20), func(b *testing.B) {
			ctx := context.Background()
			dir := b.TempDir()
			s, err := Open(ctx, &Manifest{Dir: dir, VirtualSize: 4 << 30, MaxDepth: 200, Upper: &Upper{Data: "u.data", Index: "u.index"}}, Options{})
			if err != nil {
				b.Fatal(err)
			}
			defer s.Close()
			p := make([]byte, 64<<10)
			r := rand.New(rand.NewPCG(3, 3))
			// The timer keeps running through the writes so that b.N stays
			// small (1 GiB per iteration); the restack itself is timed
			// separately and reported as ms/restack.
			var restack time.Duration
			for i := 0; i < b.N; i++ {
				for w := int64(0); w < size; w += int64(len(p)) {
					s.WriteAt(p, r.Int64N(4<<30/int64(len(p)))*int64(len(p)))
				}
				s.Sync()
				out := filepath.Join(dir, fmt.Sprintf("snap-%d", i))
				t0 := time.Now()
				if _, err := s.SealAndRestack(ctx, out); err != nil {
					b.Fatal(err)
				}
				restack += time.Since(t0)
				os.Remove(out) // bound the disk footprint; the open lower keeps its data
			}
			b.ReportMetric(float64(restack.Microseconds())/1000/float64(b.N), "ms/restack")
		})
	}
}
