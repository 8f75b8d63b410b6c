package stack

import (
	"context"
	"fmt"
	"math/rand/v2"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/aenv-dev/aenv/internal/storage/lsmt"
	"github.com/aenv-dev/aenv/internal/storage/zfile"
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

// zfileLower writes a ZFile-compressed (LZ4, 4 KiB blocks, as templates are) sealed layer
// of size bytes of compressible data into dir.
func zfileLower(b testing.TB, dir string, size int64) LayerRef {
	b.Helper()
	raw := filepath.Join(dir, "raw.img")
	data := make([]byte, size)
	r := rand.New(rand.NewPCG(4, 4))
	for i := 0; i < len(data); i += 64 {
		if r.IntN(3) > 0 { // two thirds text-like, a third zeros
			for k := range 64 {
				data[i+k] = byte('a' + r.IntN(8))
			}
		}
	}
	if err := os.WriteFile(raw, data, 0o644); err != nil {
		b.Fatal(err)
	}
	src, err := os.Open(raw)
	if err != nil {
		b.Fatal(err)
	}
	defer src.Close()
	out := filepath.Join(dir, "lower.zfile")
	f, err := os.Create(out)
	if err != nil {
		b.Fatal(err)
	}
	defer f.Close()
	z, err := zfile.NewWriter(f, zfile.WriterOptions{Algo: zfile.AlgoLZ4})
	if err != nil {
		b.Fatal(err)
	}
	info, err := lsmt.Import(z, src, lsmt.CommitOptions{})
	if err == nil {
		err = z.Close()
	}
	if err != nil {
		b.Fatal(err)
	}
	return LayerRef{Path: out, Size: info.Size, UUID: info.UUID}
}

// BenchmarkZFileLowerRead: random reads of a sandbox disk's sizes (FUSE sends up to
// 256 KiB) through a stack whose lower is a ZFile in the page cache and whose upper is
// empty, as a new sandbox reads its template; allocs/op is the read path's garbage.
func BenchmarkZFileLowerRead(b *testing.B) {
	const size = 64 << 20
	dir := b.TempDir()
	lower := zfileLower(b, dir, size)
	s, err := Open(context.Background(), &Manifest{Dir: dir, Lowers: []LayerRef{lower}, Upper: &Upper{Data: "u.data", Index: "u.index"}}, Options{})
	if err != nil {
		b.Fatal(err)
	}
	defer s.Close()
	for _, n := range []int{4 << 10, 64 << 10, 256 << 10} {
		b.Run(fmt.Sprintf("size=%dK", n>>10), func(b *testing.B) {
			buf := make([]byte, n)
			r := rand.New(rand.NewPCG(5, 5))
			b.SetBytes(int64(n))
			b.ReportAllocs()
			for b.Loop() {
				if _, err := s.ReadAt(buf, r.Int64N(size/int64(n))*int64(n)); err != nil {
					b.Fatal(err)
				}
			}
		})
	}
}

// BenchmarkOpenShared: opening a stack over a ZFile lower that other stacks hold open
// (shared) against opening it anew each time, as each sandbox of a template does.
func BenchmarkOpenShared(b *testing.B) {
	dir := b.TempDir()
	lower := zfileLower(b, dir, 256<<20)
	for _, shared := range []bool{false, true} {
		b.Run(fmt.Sprintf("shared=%v", shared), func(b *testing.B) {
			o := Options{}
			if shared {
				o.Lowers = NewLowers()
				hold, err := Open(context.Background(), &Manifest{Dir: b.TempDir(), Lowers: []LayerRef{lower}}, o)
				if err != nil {
					b.Fatal(err)
				}
				defer hold.Close()
			}
			b.ReportAllocs()
			for b.Loop() {
				s, err := Open(context.Background(), &Manifest{Dir: dir, Lowers: []LayerRef{lower}}, o)
				if err != nil {
					b.Fatal(err)
				}
				s.Close()
			}
		})
	}
}
