package stack

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"os"
	"path/filepath"
	"sync"
	"testing"
)

const vsize = 8 << 20

func newStack(t *testing.T, maxDepth int) (*Stack, string) {
	return newStackUpper(t, maxDepth, Upper{Data: "upper.data", Index: "upper.index"})
}

func newStackUpper(t *testing.T, maxDepth int, u Upper) (*Stack, string) {
	t.Helper()
	dir := t.TempDir()
	m := &Manifest{VirtualSize: vsize, MaxDepth: maxDepth, Dir: dir, Upper: &u}
	s, err := Open(context.Background(), m, Options{})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { s.Close() })
	return s, dir
}

func compare(t *testing.T, s *Stack, model []byte, step int) {
	t.Helper()
	got := make([]byte, len(model))
	if n, err := s.ReadAt(got, 0); n != len(got) || err != nil {
		t.Fatalf("step %d: read %d %v", step, n, err)
	}
	if !bytes.Equal(got, model) {
		for i := range got {
			if got[i] != model[i] {
				t.Fatalf("step %d: first difference at byte %d: %d != %d", step, i, got[i], model[i])
			}
		}
	}
}

// TestModel applies thousands of random writes, discards, seals and
// compactions to a stack and to a byte slice and compares every byte.
func TestModel(t *testing.T) {
	for _, tc := range []struct {
		u     Upper
		steps int
	}{
		{Upper{Data: "upper.data", Index: "upper.index"}, 3000},
		{Upper{Data: "upper.data", Index: "upper.index", Hybrid: true}, 1000},
		{Upper{Data: "upper.data", Sparse: true}, 1000},
	} {
		t.Run(fmt.Sprintf("hybrid=%v,sparse=%v", tc.u.Hybrid, tc.u.Sparse), func(t *testing.T) { testModel(t, tc.u, tc.steps) })
	}
}

func testModel(t *testing.T, u Upper, steps int) {
	ctx := context.Background()
	s, dir := newStackUpper(t, 4, u)
	model := make([]byte, vsize)
	r := rand.New(rand.NewPCG(42, 1))
	seals := 0
	for step := 0; step < steps; step++ {
		switch k := r.IntN(100); {
		case k < 70:
			off := r.Int64N(vsize - 1)
			n := 1 + r.IntN(min(64<<10, int(vsize-off)))
			if r.IntN(2) == 0 { // aligned
				off &^= 511
				n = (n + 511) &^ 511
				n = min(n, int(vsize-off))
			}
			p := make([]byte, n)
			for i := range p {
				p[i] = byte(r.Uint32() | 1)
			}
			if _, err := s.WriteAt(p, off); err != nil {
				t.Fatalf("step %d: write: %v", step, err)
			}
			copy(model[off:], p)
		case k < 88:
			off := r.Int64N(vsize - 1)
			n := 1 + r.Int64N(min(256<<10, vsize-off))
			if err := s.Discard(off, n); err != nil {
				t.Fatalf("step %d: discard: %v", step, err)
			}
			clear(model[off : off+n])
		case k < 95:
			off := r.Int64N(vsize)
			n := 1 + r.IntN(100000)
			p := make([]byte, n)
			got, err := s.ReadAt(p, off)
			want := min(n, int(vsize-off))
			if got != want || (err != nil && got == n) || !bytes.Equal(p[:got], model[off:off+int64(got)]) {
				t.Fatalf("step %d: read at %d+%d: %d %v", step, off, n, got, err)
			}
		default:
			seals++
			out := filepath.Join(dir, fmt.Sprintf("layer-%d.sealed", seals))
			if _, err := s.SealAndRestack(ctx, out); err != nil {
				t.Fatalf("step %d: restack: %v", step, err)
			}
			if s.Depth() > 4 {
				t.Fatalf("depth %d after restack with max 4", s.Depth())
			}
		}
		if step%500 == 499 {
			compare(t, s, model, step)
		}
	}
	compare(t, s, model, steps)
	if seals < steps/60 {
		t.Fatalf("only %d seals", seals)
	}
	// Reopen from the saved manifest.
	if err := s.Sync(); err != nil {
		t.Fatal(err)
	}
	m := s.Manifest()
	mp := filepath.Join(dir, "stack.json")
	if err := m.Save(mp); err != nil {
		t.Fatal(err)
	}
	s.Close()
	m2, err := LoadManifest(mp)
	if err != nil {
		t.Fatal(err)
	}
	s2, err := Open(ctx, m2, Options{})
	if err != nil {
		t.Fatal(err)
	}
	defer s2.Close()
	compare(t, s2, model, -1)
	// Flatten the whole stack and read it as a single layer.
	fp := filepath.Join(dir, "flat.commit")
	f, _ := os.Create(fp)
	if _, err := s2.Commit(ctx, f, lsmtCommitOptions()); err != nil {
		t.Fatal(err)
	}
	f.Close()
	s3, err := Open(ctx, &Manifest{Lowers: []LayerRef{{Path: fp}}}, Options{})
	if err != nil {
		t.Fatal(err)
	}
	defer s3.Close()
	compare(t, s3, model, -2)
	if _, err := s3.WriteAt([]byte{1}, 0); !errors.Is(err, ErrReadOnly) {
		t.Fatalf("read-only write: %v", err)
	}
}

// TestRestackUnderLoad restacks while readers and writers run.
func TestRestackUnderLoad(t *testing.T) {
	ctx := context.Background()
	s, dir := newStack(t, 0)
	var wg sync.WaitGroup
	stop := make(chan struct{})
	errs := make(chan error, 4)
	for w := 0; w < 2; w++ {
		wg.Add(1)
		go func(w int) {
			defer wg.Done()
			// Each writer owns a region and checks its own last write.
			base := int64(w) * (vsize / 2)
			buf := make([]byte, 4096)
			got := make([]byte, 4096)
			for i := 0; ; i++ {
				select {
				case <-stop:
					return
				default:
				}
				off := base + int64(i%256)*4096
				for j := range buf {
					buf[j] = byte(i + w)
				}
				if _, err := s.WriteAt(buf, off); err != nil {
					errs <- err
					return
				}
				if _, err := s.ReadAt(got, off); err != nil || !bytes.Equal(got, buf) {
					errs <- fmt.Errorf("writer %d read back mismatch at %d: %v", w, off, err)
					return
				}
			}
		}(w)
	}
	for i := 0; i < 20; i++ {
		if _, err := s.SealAndRestack(ctx, filepath.Join(dir, fmt.Sprintf("l%d", i))); err != nil {
			t.Fatal(err)
		}
	}
	close(stop)
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Fatal(err)
	}
	if s.Depth() != 20 {
		t.Fatalf("depth %d", s.Depth())
	}
}

func TestOpenErrors(t *testing.T) {
	ctx := context.Background()
	dir := t.TempDir()
	bad := filepath.Join(dir, "bad")
	os.WriteFile(bad, bytes.Repeat([]byte{7}, 16384), 0o644)
	for _, tc := range []struct {
		name string
		m    Manifest
	}{
		{"missing lower", Manifest{Dir: dir, Lowers: []LayerRef{{Path: "nope"}}}},
		{"garbage lower", Manifest{Dir: dir, Lowers: []LayerRef{{Path: "bad"}}}},
		{"no size", Manifest{Dir: dir}},
		{"digest without resolver", Manifest{Dir: dir, Lowers: []LayerRef{{Digest: "sha256:00"}}}},
		{"unaligned size", Manifest{Dir: dir, VirtualSize: 1000, Upper: &Upper{Data: "d", Index: "i"}}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			if s, err := Open(ctx, &tc.m, Options{}); err == nil {
				s.Close()
				t.Fatal("accepted")
			}
		})
	}
	if _, err := os.Stat(filepath.Join(dir, "d")); !os.IsNotExist(err) {
		t.Fatal("failed open left an upper behind")
	}
}

func TestRestackOtherFilesystem(t *testing.T) {
	s, dir := newStack(t, 0)
	s.WriteAt(make([]byte, 4096), 0)
	// /dev/shm is a tmpfs, the test dir is not (or the check is moot).
	if sameFS("/dev/shm", t.TempDir()) {
		t.Skip("/dev/shm and the temp dir share a filesystem")
	}
	if _, err := s.SealAndRestack(context.Background(), "/dev/shm/aenv-restack-test"); err == nil {
		os.Remove("/dev/shm/aenv-restack-test")
		t.Fatal("cross-filesystem restack accepted")
	}
	// The stack is unchanged and still usable.
	if _, err := s.WriteAt(make([]byte, 4096), 4096); err != nil {
		t.Fatal(err)
	}
	if _, err := s.SealAndRestack(context.Background(), filepath.Join(dir, "ok.sealed")); err != nil {
		t.Fatal(err)
	}
}

// TestDropSyncs: once DropSyncs ran, Sync and StartWriteback succeed without making
// anything durable (the upper stays unsynced), and the stack still serves reads and
// writes; without it Sync does sync.
func TestDropSyncs(t *testing.T) {
	for _, dropped := range []bool{false, true} {
		t.Run(fmt.Sprintf("dropped=%v", dropped), func(t *testing.T) {
			s, _ := newStack(t, 1)
			if dropped {
				s.DropSyncs()
			}
			p := bytes.Repeat([]byte{9}, 4096)
			if _, err := s.WriteAt(p, 8192); err != nil {
				t.Fatal(err)
			}
			if err := s.StartWriteback(); err != nil {
				t.Fatal(err)
			}
			if err := s.Sync(); err != nil {
				t.Fatal(err)
			}
			if got := s.Synced(); got == dropped {
				t.Fatalf("dropped %v: upper synced %v after Sync", dropped, got)
			}
			got := make([]byte, 4096)
			if _, err := s.ReadAt(got, 8192); err != nil || !bytes.Equal(got, p) {
				t.Fatalf("read back: %v", err)
			}
		})
	}
}
