package cache

import (
	"bytes"
	"context"
	"math/rand/v2"
	"os"
	"path/filepath"
	"sync"
	"sync/atomic"
	"testing"
	"time"
)

type memSource struct {
	b       []byte
	fetches atomic.Int64
	delay   time.Duration
}

func (m *memSource) Size() int64 { return int64(len(m.b)) }
func (m *memSource) ReadAt(_ context.Context, p []byte, off int64) (int, error) {
	m.fetches.Add(1)
	time.Sleep(m.delay)
	return copy(p, m.b[off:]), nil
}

func blobOf(n int) []byte {
	r := rand.New(rand.NewPCG(5, 5))
	b := make([]byte, n)
	for i := range b {
		b[i] = byte(r.Uint32())
	}
	return b
}

const bs = 64 << 10

func TestEvictionAndRefetchTinyCache(t *testing.T) {
	dir := t.TempDir()
	c, err := Open(Options{Dir: dir, MaxBytes: 8 * bs, BlockSize: bs})
	if err != nil {
		t.Fatal(err)
	}
	src := &memSource{b: blobOf(40*bs + 1000)}
	f := c.File("sha256:x", src)
	got := make([]byte, len(src.b))
	if n, err := f.ReadAt(got, 0); n != len(got) || err != nil || !bytes.Equal(got, src.b) {
		t.Fatalf("read %d %v", n, err)
	}
	st := c.Stats()
	if st.UsedBytes > 8*bs || st.Evictions == 0 {
		t.Fatalf("stats %+v: not bounded", st)
	}
	// Early blocks were evicted: reading them fetches again and is correct.
	before := src.fetches.Load()
	p := make([]byte, 100)
	if _, err := f.ReadAt(p, 10); err != nil || !bytes.Equal(p, src.b[10:110]) {
		t.Fatal(err)
	}
	if src.fetches.Load() != before+1 {
		t.Fatalf("expected a refetch")
	}
	// Random reads keep the bound and the bytes.
	r := rand.New(rand.NewPCG(1, 2))
	for i := 0; i < 300; i++ {
		off := r.Int64N(int64(len(src.b)))
		q := make([]byte, 1+r.IntN(3*bs))
		n, _ := f.ReadAt(q, off)
		if !bytes.Equal(q[:n], src.b[off:off+int64(n)]) {
			t.Fatalf("mismatch at %d", off)
		}
	}
	if u := c.Stats().UsedBytes; u > 8*bs {
		t.Fatalf("used %d > max", u)
	}
	var disk int64
	filepath.Walk(dir, func(_ string, fi os.FileInfo, _ error) error {
		if fi != nil && !fi.IsDir() {
			disk += fi.Size()
		}
		return nil
	})
	if disk != c.Stats().UsedBytes {
		t.Fatalf("on disk %d, accounted %d", disk, c.Stats().UsedBytes)
	}
}

func TestSurvivesRestartAndCorruption(t *testing.T) {
	dir := t.TempDir()
	src := &memSource{b: blobOf(4 * bs)}
	c, _ := Open(Options{Dir: dir, MaxBytes: 100 * bs, BlockSize: bs})
	f := c.File("k", src)
	buf := make([]byte, len(src.b))
	f.ReadAt(buf, 0)
	if src.fetches.Load() != 4 {
		t.Fatalf("fetches %d", src.fetches.Load())
	}
	os.WriteFile(filepath.Join(dir, f.dir, "9.tmp123"), []byte("junk"), 0o644)
	c2, err := Open(Options{Dir: dir, MaxBytes: 100 * bs, BlockSize: bs})
	if err != nil {
		t.Fatal(err)
	}
	f2 := c2.File("k", src)
	if _, err := f2.ReadAt(buf, 0); err != nil || !bytes.Equal(buf, src.b) {
		t.Fatal(err)
	}
	if src.fetches.Load() != 4 || c2.Stats().Hits != 4 {
		t.Fatalf("after restart: fetches %d stats %+v", src.fetches.Load(), c2.Stats())
	}
	if _, err := os.Stat(filepath.Join(dir, f.dir, "9.tmp123")); !os.IsNotExist(err) {
		t.Fatal("temp file not cleaned")
	}
	// Flip a byte inside block 2: detected, dropped, refetched.
	bp := filepath.Join(dir, f.dir, "2")
	b, _ := os.ReadFile(bp)
	b[5000] ^= 0xff
	os.WriteFile(bp, b, 0o644)
	p := make([]byte, 10)
	if _, err := f2.ReadAt(p, 2*bs+4999); err != nil || !bytes.Equal(p, src.b[2*bs+4999:2*bs+5009]) {
		t.Fatalf("corrupt block served: %v", err)
	}
	if c2.Stats().Corrupt != 1 || src.fetches.Load() != 5 {
		t.Fatalf("stats %+v fetches %d", c2.Stats(), src.fetches.Load())
	}
}

func TestSingleflight(t *testing.T) {
	c, _ := Open(Options{Dir: t.TempDir(), MaxBytes: 100 * bs, BlockSize: bs})
	src := &memSource{b: blobOf(bs), delay: 50 * time.Millisecond}
	f := c.File("k", src)
	var wg sync.WaitGroup
	for i := 0; i < 16; i++ {
		wg.Add(1)
		go func(i int) {
			defer wg.Done()
			p := make([]byte, 100)
			if _, err := f.ReadAt(p, int64(i*100)); err != nil || !bytes.Equal(p, src.b[i*100:i*100+100]) {
				t.Error("bad read", err)
			}
		}(i)
	}
	wg.Wait()
	if n := src.fetches.Load(); n != 1 {
		t.Fatalf("%d fetches for one block", n)
	}
}

// TestSequentialAmplification: a sequential read fetches each byte about
// once (bytes fetched / bytes read ≤ 1.1 at 1 MiB blocks).
func TestSequentialAmplification(t *testing.T) {
	c, _ := Open(Options{Dir: t.TempDir(), MaxBytes: 64 << 20, Prefetch: true})
	src := &memSource{b: blobOf(20<<20 + 12345)}
	f := c.File("k", src)
	p := make([]byte, 128<<10)
	for off := int64(0); off < src.Size(); off += int64(len(p)) {
		f.ReadAt(p, off)
	}
	c.Close()
	st := c.Stats()
	amp := float64(st.FetchedBytes) / float64(st.ReadBytes)
	t.Logf("read amplification %.4f (%d fetched / %d read)", amp, st.FetchedBytes, st.ReadBytes)
	if amp > 1.1 {
		t.Fatalf("amplification %.3f", amp)
	}
}

// TestReadahead: a sequential read of blocks k-1, k fetches up to Readahead
// blocks past k in the background, and never past the end of the file; a
// random read fetches only its own block.
func TestReadahead(t *testing.T) {
	const bs = 64 << 10
	for _, tc := range []struct {
		name      string
		readahead int
		reads     []int64 // block numbers, in order
		want      int64   // blocks fetched once prefetches settle
	}{
		{"off sequential", 0, []int64{0, 1}, 2},
		{"one sequential", 1, []int64{0, 1}, 3},
		{"four sequential", 4, []int64{0, 1}, 6},
		{"four random", 4, []int64{5, 2}, 2},
		{"four at the end", 4, []int64{7, 8}, 3}, // 10 blocks: only 9 is left
	} {
		t.Run(tc.name, func(t *testing.T) {
			c, err := Open(Options{Dir: t.TempDir(), MaxBytes: 64 << 20, BlockSize: bs, Readahead: tc.readahead})
			if err != nil {
				t.Fatal(err)
			}
			src := &memSource{b: blobOf(10 * bs)}
			f := c.File("k", src)
			p := make([]byte, 100)
			for _, k := range tc.reads {
				if _, err := f.ReadAt(p, k*bs); err != nil {
					t.Fatal(err)
				}
				if !bytes.Equal(p, src.b[k*bs:k*bs+100]) {
					t.Fatalf("block %d read wrong", k)
				}
			}
			c.Close() // waits for prefetches
			if got := c.Stats().FetchedBytes / bs; got != tc.want {
				t.Fatalf("fetched %d blocks, want %d", got, tc.want)
			}
		})
	}
}

func TestOptionsValidation(t *testing.T) {
	for _, o := range []Options{{MaxBytes: 0}, {MaxBytes: 1, BlockSize: 1000}, {MaxBytes: 1, HighWater: 0.5, LowWater: 0.7},
		{MaxBytes: 1, Readahead: -1}} {
		o.Dir = t.TempDir()
		if _, err := Open(o); err == nil {
			t.Errorf("%+v accepted", o)
		}
	}
}
