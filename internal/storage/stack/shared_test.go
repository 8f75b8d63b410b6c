package stack

import (
	"bytes"
	"context"
	"fmt"
	"os"
	"path/filepath"
	"sync"
	"testing"
	"time"

	"github.com/aenv-dev/aenv/internal/storage/zfile"
)

// sealedLayers writes n sealed layers into dir (layer i sets the first 64 KiB of its
// own MiB to byte i+1) and returns their refs, bottom first, with the device's content.
func sealedLayers(t *testing.T, dir string, n int) ([]LayerRef, []byte) {
	t.Helper()
	ctx := context.Background()
	m := &Manifest{VirtualSize: vsize, Dir: dir, Upper: &Upper{Data: "seed.data", Index: "seed.index"}}
	s, err := Open(ctx, m, Options{})
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	model := make([]byte, vsize)
	var refs []LayerRef
	for i := range n {
		p := bytes.Repeat([]byte{byte(i + 1)}, 64<<10)
		off := int64(i) << 20
		if _, err := s.WriteAt(p, off); err != nil {
			t.Fatal(err)
		}
		copy(model[off:], p)
		ref, err := s.SealAndRestack(ctx, filepath.Join(dir, fmt.Sprintf("layer%d.lsmt", i)))
		if err != nil {
			t.Fatal(err)
		}
		refs = append(refs, ref)
	}
	return refs, model
}

func openShared(t *testing.T, ls *Lowers, lowers []LayerRef) *Stack {
	t.Helper()
	m := &Manifest{Dir: t.TempDir(), Lowers: lowers, Upper: &Upper{Data: "upper.data", Index: "upper.index"}}
	s, err := Open(context.Background(), m, Options{Lowers: ls})
	if err != nil {
		t.Fatal(err)
	}
	return s
}

func wantStats(t *testing.T, ls *Lowers, want LowersStats) {
	t.Helper()
	if got := ls.Stats(); got != want {
		t.Fatalf("lowers hold %+v, want %+v", got, want)
	}
}

// TestSharedLowers: stacks on the same lowers share them and their merged index; each
// keeps its own upper; a restack, a compaction or a close of one leaves the others
// reading what they did; the last close closes every layer.
func TestSharedLowers(t *testing.T) {
	ctx := context.Background()
	refs, model := sealedLayers(t, t.TempDir(), 3)
	ls := NewLowers()
	var stacks []*Stack
	for range 3 {
		stacks = append(stacks, openShared(t, ls, refs))
	}
	wantStats(t, ls, LowersStats{Layers: 3, Refs: 9, Merged: 1})
	for i, s := range stacks {
		compare(t, s, model, i)
	}

	// The first stack writes, seals and compacts; the others do not see it.
	s0 := stacks[0]
	own := append([]byte(nil), model...)
	p := bytes.Repeat([]byte{0xee}, 4096)
	if _, err := s0.WriteAt(p, 5<<20); err != nil {
		t.Fatal(err)
	}
	copy(own[5<<20:], p)
	out := filepath.Join(s0.Manifest().Dir, "sealed.lsmt")
	if _, err := s0.SealAndRestack(ctx, out); err != nil {
		t.Fatal(err)
	}
	wantStats(t, ls, LowersStats{Layers: 4, Refs: 10, Merged: 1})
	if _, err := s0.Compact(ctx, filepath.Join(s0.Manifest().Dir, "compact.lsmt"), 3); err != nil {
		t.Fatal(err)
	}
	// s0: layer0 + its compaction (a merged index of its own); the others: layers 0-2.
	wantStats(t, ls, LowersStats{Layers: 4, Refs: 8, Merged: 2})
	compare(t, s0, own, 100)
	compare(t, stacks[1], model, 101)

	// A hard link to a layer is the same layer; a copy put in place of one is not.
	link := filepath.Join(t.TempDir(), "link.lsmt")
	if err := os.Link(refs[0].Path, link); err != nil {
		t.Fatal(err)
	}
	linked := append([]LayerRef{{Path: link}}, refs[1:]...)
	sl := openShared(t, ls, linked)
	wantStats(t, ls, LowersStats{Layers: 4, Refs: 11, Merged: 2})
	compare(t, sl, model, 102)
	raw, err := os.ReadFile(refs[2].Path)
	if err != nil {
		t.Fatal(err)
	}
	tmp := refs[2].Path + ".tmp"
	if err := os.WriteFile(tmp, raw, 0o644); err != nil {
		t.Fatal(err)
	}
	if err := os.Rename(tmp, refs[2].Path); err != nil {
		t.Fatal(err)
	}
	sr := openShared(t, ls, refs)
	wantStats(t, ls, LowersStats{Layers: 5, Refs: 14, Merged: 3})
	compare(t, sr, model, 103)

	for _, s := range append(stacks, sl, sr) {
		if err := s.Close(); err != nil {
			t.Fatal(err)
		}
	}
	wantStats(t, ls, LowersStats{})
}

// TestSharedLowersOpenError: a lower that fails to open fails every stack waiting on it
// and leaves nothing behind; the next open tries again.
func TestSharedLowersOpenError(t *testing.T) {
	dir := t.TempDir()
	refs, model := sealedLayers(t, dir, 2)
	bad := filepath.Join(dir, "bad.lsmt")
	if err := os.WriteFile(bad, bytes.Repeat([]byte{1}, 8192), 0o644); err != nil {
		t.Fatal(err)
	}
	ls := NewLowers()
	for _, lowers := range [][]LayerRef{
		{refs[0], {Path: bad}},
		{refs[0], {Path: filepath.Join(dir, "missing.lsmt")}},
		{{Digest: "sha256:ab"}}, // no resolver
	} {
		m := &Manifest{Dir: t.TempDir(), Lowers: lowers, Upper: &Upper{Data: "upper.data", Index: "upper.index"}}
		if s, err := Open(context.Background(), m, Options{Lowers: ls}); err == nil {
			s.Close()
			t.Fatalf("open of %v succeeded", lowers)
		}
		wantStats(t, ls, LowersStats{})
	}
	s := openShared(t, ls, refs)
	compare(t, s, model, 0)
	s.Close()
	wantStats(t, ls, LowersStats{})
}

// TestSharedLowersConcurrent opens, reads, restacks and closes stacks on the same lowers
// from many goroutines (run it with -race); nothing stays open at the end.
func TestSharedLowersConcurrent(t *testing.T) {
	refs, model := sealedLayers(t, t.TempDir(), 3)
	ls := NewLowers()
	var wg sync.WaitGroup
	errs := make(chan error, 64)
	for g := range 8 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := range 6 {
				m := &Manifest{Dir: t.TempDir(), Lowers: refs[:1+(g+i)%3], Upper: &Upper{Data: "upper.data", Index: "upper.index"}}
				s, err := Open(context.Background(), m, Options{Lowers: ls})
				if err != nil {
					errs <- err
					return
				}
				got := make([]byte, 4<<20)
				if _, err := s.ReadAt(got, 0); err != nil {
					errs <- err
				}
				n := 1 + (g+i)%3
				want := make([]byte, len(got))
				for k := range n {
					copy(want[k<<20:], model[k<<20:k<<20+64<<10])
				}
				if !bytes.Equal(got, want) {
					errs <- fmt.Errorf("goroutine %d: stack of %d lowers reads wrong data", g, n)
				}
				if i%2 == 1 {
					if _, err := s.SealAndRestack(context.Background(), filepath.Join(m.Dir, "sealed.lsmt")); err != nil {
						errs <- err
					}
				}
				if err := s.Close(); err != nil {
					errs <- err
				}
			}
		}()
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Error(err)
	}
	wantStats(t, ls, LowersStats{})
}

// slowResolver opens layers by digest from files; its first open waits for its context.
type slowResolver struct {
	paths   map[string]string
	started chan struct{}
	mu      sync.Mutex
	calls   int
}

func (r *slowResolver) OpenLayer(ctx context.Context, ref LayerRef) (Source, error) {
	r.mu.Lock()
	r.calls++
	first := r.calls == 1
	r.mu.Unlock()
	if first {
		close(r.started)
		<-ctx.Done()
		return nil, ctx.Err()
	}
	return openFileSource(r.paths[ref.Digest])
}

// TestSharedLowersOpenerCanceled: a stack waiting for a layer another stack is opening
// does not fail because the other's context ended; it opens the layer itself.
func TestSharedLowersOpenerCanceled(t *testing.T) {
	refs, model := sealedLayers(t, t.TempDir(), 1)
	res := &slowResolver{paths: map[string]string{"sha256:l0": refs[0].Path}, started: make(chan struct{})}
	ls := NewLowers()
	byDigest := []LayerRef{{Digest: "sha256:l0"}}
	open := func(ctx context.Context) (*Stack, error) {
		return Open(ctx, &Manifest{Dir: t.TempDir(), Lowers: byDigest, Upper: &Upper{Data: "u.data", Index: "u.index"}}, Options{Lowers: ls, Resolver: res})
	}
	ctx, cancel := context.WithCancel(context.Background())
	first := make(chan error, 1)
	go func() {
		s, err := open(ctx)
		if err == nil {
			s.Close()
		}
		first <- err
	}()
	<-res.started
	second := make(chan *Stack, 1)
	go func() {
		s, err := open(context.Background())
		if err != nil {
			t.Error(err)
		}
		second <- s
	}()
	// Let the second open find the first's entry before the first fails.
	for ls.Stats().Refs < 2 {
		time.Sleep(time.Millisecond)
	}
	cancel()
	if err := <-first; err == nil {
		t.Fatal("the canceled open succeeded")
	}
	s := <-second
	if s == nil {
		t.FailNow()
	}
	compare(t, s, model, 0)
	wantStats(t, ls, LowersStats{Layers: 1, Refs: 1, Merged: 1})
	s.Close()
	wantStats(t, ls, LowersStats{})
}

// TestSharedLowersBlockCache: stacks of a Lowers with a block cache read their compressed
// lowers as stacks without one do, and a block one stack decompressed is read by the next
// from the cache.
func TestSharedLowersBlockCache(t *testing.T) {
	ref := zfileLower(t, t.TempDir(), 4<<20)
	plain := openShared(t, NewLowers(), []LayerRef{ref})
	defer plain.Close()
	c := zfile.NewBlockCache(8 << 20)
	ls := NewLowersCached(c)
	a, b := openShared(t, ls, []LayerRef{ref}), openShared(t, ls, []LayerRef{ref})
	defer a.Close()
	defer b.Close()
	want, got := make([]byte, 256<<10), make([]byte, 256<<10)
	for _, off := range []int64{0, 1<<20 + 512, 3 << 20} {
		if _, err := plain.ReadAt(want, off); err != nil {
			t.Fatal(err)
		}
		if _, err := a.ReadAt(got, off); err != nil || !bytes.Equal(got, want) {
			t.Fatalf("a cached stack reads other bytes at %d (%v)", off, err)
		}
		before := c.Stats()
		if _, err := b.ReadAt(got, off); err != nil || !bytes.Equal(got, want) {
			t.Fatalf("the second cached stack reads other bytes at %d (%v)", off, err)
		}
		if after := ls.CacheStats(); after.Misses != before.Misses || after.Hits <= before.Hits {
			t.Fatalf("the second stack's read at %d was not served from the cache: %+v then %+v", off, before, after)
		}
	}
}
