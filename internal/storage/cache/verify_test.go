package cache

import (
	"bytes"
	"crypto/sha256"
	"errors"
	"io"
	"sync"
	"testing"
	"time"
)

func sumsOf(b []byte, chunk int64) *Sums {
	s := &Sums{Chunk: chunk}
	for off := int64(0); off < int64(len(b)); off += chunk {
		s.Sums = append(s.Sums, sha256.Sum256(b[off:min(off+chunk, int64(len(b)))]))
	}
	return s
}

// TestVerifiedFetch: a corrupt byte fails the reads of its chunk with
// ErrVerify and is never cached; every other block still reads, whatever
// the chunk size is relative to the cache's block size.
func TestVerifiedFetch(t *testing.T) {
	const size = 10*bs + 1234 // a short last block and chunk
	for _, tc := range []struct {
		name  string
		chunk int64
	}{
		{"chunk smaller than block", bs / 4},
		{"chunk equal to block", bs},
		{"chunk larger than block", 4 * bs},
	} {
		t.Run(tc.name, func(t *testing.T) {
			good := blobOf(size)
			src := &memSource{b: bytes.Clone(good)}
			c, err := Open(Options{Dir: t.TempDir(), MaxBytes: 64 << 20, BlockSize: bs})
			if err != nil {
				t.Fatal(err)
			}
			defer c.Close()
			bad := int64(5*bs + 77)
			src.b[bad]++
			f, err := c.FileVerified("k", src, sumsOf(good, tc.chunk))
			if err != nil {
				t.Fatal(err)
			}
			// What a miss fetches and verifies as one: a block, or a chunk
			// when chunks are larger.
			unit := max(tc.chunk, int64(bs))
			badLo, badHi := bad/unit*unit, bad/unit*unit+unit
			p := make([]byte, 100)
			for off := int64(0); off < size; off += 1000 {
				n, err := f.ReadAt(p, off)
				inBad := off < badHi && min(off+int64(len(p)), size) > badLo
				switch {
				case inBad && !errors.Is(err, ErrVerify):
					t.Fatalf("ReadAt(%d) over the corrupt chunk: %d, %v", off, n, err)
				case !inBad && err != nil && err != io.EOF:
					t.Fatalf("ReadAt(%d): %v", off, err)
				case !inBad && !bytes.Equal(p[:n], good[off:off+int64(n)]):
					t.Fatalf("ReadAt(%d): wrong bytes", off)
				}
			}
			st := c.Stats()
			if st.VerifyFailures == 0 {
				t.Fatalf("stats %+v: no verify failure counted", st)
			}
			// Nothing of the bad chunk was cached: with the source
			// repaired, the read fetches and succeeds.
			fetches := src.fetches.Load()
			src.b[bad]--
			if _, err := f.ReadAt(p, bad); err != nil {
				t.Fatalf("after repair: %v", err)
			}
			if !bytes.Equal(p, good[bad:bad+100]) || src.fetches.Load() == fetches {
				t.Fatalf("after repair: wrong bytes or served from the cache")
			}
			// Cached good blocks are served without fetching again.
			fetches = src.fetches.Load()
			if _, err := f.ReadAt(p, 0); err != nil || src.fetches.Load() != fetches {
				t.Fatalf("cached block refetched (%v)", err)
			}
		})
	}
}

func TestFileVerifiedRejectsBadSums(t *testing.T) {
	c, err := Open(Options{Dir: t.TempDir(), MaxBytes: 64 << 20, BlockSize: bs})
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	src := &memSource{b: blobOf(3 * bs)}
	for name, s := range map[string]*Sums{
		"nil":         nil,
		"odd chunk":   {Chunk: 5000, Sums: make([][32]byte, 1)},
		"tiny chunk":  {Chunk: 512, Sums: make([][32]byte, 3*bs/512)},
		"wrong count": {Chunk: bs, Sums: make([][32]byte, 2)},
		"extra sums":  {Chunk: bs, Sums: make([][32]byte, 4)},
	} {
		if _, err := c.FileVerified("k", src, s); err == nil {
			t.Errorf("%s: accepted", name)
		}
	}
}

// TestVerifiedConcurrentBlocksOfOneChunk: readers of different blocks of one
// chunk (larger than a block) share its fetch and each gets its own block.
func TestVerifiedConcurrentBlocksOfOneChunk(t *testing.T) {
	good := blobOf(8 * bs)
	src := &memSource{b: good, delay: 20 * time.Millisecond}
	c, err := Open(Options{Dir: t.TempDir(), MaxBytes: 64 << 20, BlockSize: bs})
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	f, err := c.FileVerified("k", src, sumsOf(good, 4*bs))
	if err != nil {
		t.Fatal(err)
	}
	var wg sync.WaitGroup
	errs := make([]error, 8)
	for k := range 8 {
		wg.Go(func() {
			p := make([]byte, bs)
			if _, err := f.ReadAt(p, int64(k)*bs); err != nil {
				errs[k] = err
			} else if !bytes.Equal(p, good[k*bs:(k+1)*bs]) {
				errs[k] = errors.New("wrong bytes")
			}
		})
	}
	wg.Wait()
	for k, err := range errs {
		if err != nil {
			t.Errorf("block %d: %v", k, err)
		}
	}
	if n := src.fetches.Load(); n > 4 {
		t.Errorf("%d fetches for 2 chunks", n)
	}
}
