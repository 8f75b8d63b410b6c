package zfile

import (
	"bytes"
	"io"
	"math/rand/v2"
	"os"
	"testing"
)

// TestBlockCache: readers sharing a cache read the same bytes as without one, whatever
// the offsets and lengths (blocks partly cached, the short last block, reads that end
// past the end), decompress a block once while it stays cached, stay within the budget,
// and a closed reader's blocks go.
func TestBlockCache(t *testing.T) {
	data := sample(1<<20 + 1234)
	tests := []struct {
		name  string
		o     WriterOptions
		budge int64
	}{
		{"lz4-4k", WriterOptions{Algo: AlgoLZ4}, 2 << 20},
		{"lz4-4k-small-budget", WriterOptions{Algo: AlgoLZ4}, 64 << 10},
		{"zstd-16k", WriterOptions{Algo: AlgoZstd, BlockSize: 16 << 10}, 2 << 20},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			z := build(t, data, tc.o, true)
			c := NewBlockCache(tc.budge)
			var readers []*Reader
			for range 2 {
				r, err := Open(bytes.NewReader(z), int64(len(z)), tc.name)
				if err != nil {
					t.Fatal(err)
				}
				r.UseCache(c)
				readers = append(readers, r)
			}
			rr := rand.New(rand.NewPCG(3, 3))
			for i := range 400 {
				r := readers[i%2]
				off := rr.IntN(len(data) + 100)
				n := 1 + rr.IntN(200000)
				p := make([]byte, n)
				got, err := r.ReadAt(p, int64(off))
				want := max(0, min(n, len(data)-off))
				if got != want || (want < n) != (err == io.EOF) || err != nil && err != io.EOF {
					t.Fatalf("read %d+%d: %d, %v; want %d", off, n, got, err, want)
				}
				if !bytes.Equal(p[:got], data[off:off+got]) {
					t.Fatalf("read %d+%d differs from the data", off, n)
				}
				if st := c.Stats(); st.Bytes > tc.budge {
					t.Fatalf("the cache holds %d bytes, over its %d", st.Bytes, tc.budge)
				}
			}
			// Read twice: the second time every block comes from the cache.
			p := make([]byte, 32<<10)
			readers[0].ReadAt(p, 8192)
			before := c.Stats()
			readers[0].ReadAt(p, 8192)
			if after := c.Stats(); after.Misses != before.Misses || after.Hits == before.Hits {
				t.Fatalf("a second read of the same blocks missed: %+v then %+v", before, after)
			}
			for _, r := range readers {
				r.Close()
			}
			if st := c.Stats(); st.Bytes != 0 || st.Blocks != 0 {
				t.Fatalf("closed readers left %+v in the cache", st)
			}
		})
	}
}

// BenchmarkCachedRead reads the same 4 MiB of an executable (this test binary: what a
// sandbox's first command reads) 128 KiB at a time, from the cache and without.
func BenchmarkCachedRead(b *testing.B) {
	exe, err := os.Executable()
	if err != nil {
		b.Fatal(err)
	}
	data, err := os.ReadFile(exe)
	if err != nil {
		b.Fatal(err)
	}
	data = data[:min(len(data), 4<<20)]
	z := build(b, data, WriterOptions{Algo: AlgoLZ4}, true)
	for _, cache := range []bool{false, true} {
		name := "uncached"
		if cache {
			name = "cached"
		}
		b.Run(name, func(b *testing.B) {
			r, err := Open(bytes.NewReader(z), int64(len(z)), "b")
			if err != nil {
				b.Fatal(err)
			}
			if cache {
				r.UseCache(NewBlockCache(16 << 20))
			}
			p := make([]byte, 128<<10)
			b.SetBytes(int64(len(p)))
			for i := 0; b.Loop(); i++ {
				r.ReadAt(p, int64(i%32)*int64(len(p)))
			}
		})
	}
}
