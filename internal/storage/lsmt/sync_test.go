package lsmt

import (
	"bytes"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
)

const syncTestVSize = 16 << 20

// crashImages records, for each file, its contents when its last fsync began: all a
// host crash is sure to keep. Tests build a layer from them to see what a crash right
// after a Sync (or a skipped one) leaves.
type crashImages struct {
	mu     sync.Mutex
	images map[string][]byte
	calls  int
	fail   bool // the next fsync fails (after the file was not synced)
}

func (c *crashImages) sync(f *os.File) error {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.calls++
	if c.fail {
		c.fail = false
		return errors.New("injected fsync failure")
	}
	b, err := os.ReadFile(f.Name())
	if err != nil {
		return err
	}
	c.images[filepath.Base(f.Name())] = b
	return f.Sync()
}

// restore writes the images into dir as the files a crash leaves (a file never
// synced is left empty).
func (c *crashImages) restore(t *testing.T, dir string, names ...string) {
	t.Helper()
	c.mu.Lock()
	defer c.mu.Unlock()
	for _, n := range names {
		if err := os.WriteFile(filepath.Join(dir, n), c.images[n], 0o644); err != nil {
			t.Fatal(err)
		}
	}
}

// TestSyncSkipsOnlyWhenClean runs sequences of operations and checks, at every sync,
// how many files were fsynced and that a crash right after it keeps every write that
// returned before it: a Sync may skip its fsyncs only when nothing changed since the
// last successful one.
func TestSyncSkipsOnlyWhenClean(t *testing.T) {
	tests := []struct {
		name string
		kind string // "log" (data + index), "sparse" (one file) or "hybrid"
		// ops: wA/wB (write block A or B with a new pattern), oA (overwrite A, same
		// length), dA (discard A), f (Flush), r (close and reopen: a new process), x (the
		// next fsync fails), sN (Sync, expecting N fsync calls; after each, a crash image
		// must hold every write that returned before it).
		ops string
	}{
		{"nothing written: a synced create needs no fsync", "log", "s0"},
		{"write then sync", "log", "wA s2"},
		{"second sync finds nothing new", "log", "wA s2 s0 s0"},
		{"write after a sync is synced", "log", "wA s2 wB s2"},
		{"overwrite after a sync is synced", "log", "wA s2 oA s2 s0"},
		{"discard after a sync is synced", "log", "wA s2 dA s2 s0"},
		{"flush is not a sync", "log", "wA f s2 f s0"},
		{"failed fsync is retried", "log", "wA x s1 s2 s0"},
		{"reopen syncs what the previous writer left", "log", "wA r s2 s0"},
		{"reopen after a sync", "log", "wA s2 r s2 wB s2"},
		{"sparse: write after a sync is synced", "sparse", "wA s1 s0 wB s1 dA s1 s0"},
		{"hybrid: in-place overwrite after a sync is synced", "hybrid", "wA s2 oA s2 s0 oA oA s2"},
		{"unsynced create is synced without writes", "nosync", "s2 s0 wA s2"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			dir := t.TempDir()
			d, i := filepath.Join(dir, "upper.data"), filepath.Join(dir, "upper.index")
			files := []string{"upper.data", "upper.index"}
			o := CreateOptions{VirtualSize: syncTestVSize}
			switch tt.kind {
			case "sparse":
				o.Sparse, files = true, files[:1]
			case "hybrid":
				o.Hybrid = true
			case "nosync":
				o.NoSync = true
			}
			c := &crashImages{images: map[string][]byte{}}
			l, err := CreateRW(d, i, o)
			if err != nil {
				t.Fatal(err)
			}
			l.syncFile = c.sync
			defer func() { l.Close() }()
			if !o.NoSync {
				// CreateRW synced the headers itself: that is the first image.
				c.restoreFrom(t, d, i, files)
			}
			model := make(modelDisk, syncTestVSize)
			synced := make(modelDisk, syncTestVSize)
			blocks := map[byte]int64{'A': 1 << 20, 'B': 8 << 20}
			gen := byte(0)
			for _, op := range strings.Fields(tt.ops) {
				switch op[0] {
				case 'w', 'o':
					gen++
					p := bytes.Repeat([]byte{gen}, 64<<10)
					off := blocks[op[1]]
					if _, err := l.WriteAt(p, off); err != nil {
						t.Fatal(err)
					}
					copy(model[off:], p)
				case 'd':
					off := blocks[op[1]]
					if err := l.Discard(off, 64<<10); err != nil {
						t.Fatal(err)
					}
					clear(model[off : off+64<<10])
				case 'f':
					if err := l.Flush(); err != nil {
						t.Fatal(err)
					}
				case 'r':
					if err := l.Close(); err != nil {
						t.Fatal(err)
					}
					if l, err = OpenRW(d, i); err != nil {
						t.Fatal(err)
					}
					l.syncFile = c.sync
				case 'x':
					c.fail = true
				case 's':
					var want int
					fmt.Sscanf(op[1:], "%d", &want)
					before := c.calls
					err := l.Sync()
					if got := c.calls - before; got != want {
						t.Fatalf("%s: %d fsyncs, want %d", op, got, want)
					}
					if err != nil {
						if c.fail || want == 0 {
							t.Fatal(err)
						}
						continue // the injected failure: nothing was promised
					}
					copy(synced, model)
					crash := t.TempDir()
					c.restore(t, crash, files...)
					checkCrash(t, crash, tt.kind == "sparse", synced)
				}
			}
		})
	}
}

// restoreFrom records the files as they are now (just synced by CreateRW).
func (c *crashImages) restoreFrom(t *testing.T, d, i string, files []string) {
	t.Helper()
	for _, p := range []string{d, i}[:len(files)] {
		b, err := os.ReadFile(p)
		if err != nil {
			t.Fatal(err)
		}
		c.images[filepath.Base(p)] = b
	}
}

// checkCrash opens the layer a crash left in dir and compares it with want.
func checkCrash(t *testing.T, dir string, sparse bool, want modelDisk) {
	t.Helper()
	idx := filepath.Join(dir, "upper.index")
	if sparse {
		idx = ""
	}
	l, err := OpenRW(filepath.Join(dir, "upper.data"), idx)
	if err != nil {
		t.Fatalf("open the layer a crash after the sync left: %v", err)
	}
	defer l.Close()
	for _, off := range []int64{1 << 20, 8 << 20} {
		got := make([]byte, 64<<10)
		if _, err := l.ReadAt(got, off); err != nil {
			t.Fatal(err)
		}
		if !bytes.Equal(got, want[off:off+64<<10]) {
			t.Fatalf("a crash after the sync lost a write at %d: got byte %d, want %d", off, got[0], want[off])
		}
	}
}

// TestSyncConcurrentWrites checks, with writers and syncers racing, that every Sync
// that returns is covered by an fsync of the data file that began after the caller's
// last write returned and ended before the Sync returned (run it with -race).
func TestSyncConcurrentWrites(t *testing.T) {
	l, _, _ := newRW(t)
	var started, doneMaxStart atomic.Int64
	l.syncFile = func(f *os.File) error {
		var seq int64
		if f.Name() == l.dataPath {
			seq = started.Add(1)
		}
		err := f.Sync()
		if seq > 0 {
			for {
				m := doneMaxStart.Load()
				if m >= seq || doneMaxStart.CompareAndSwap(m, seq) {
					break
				}
			}
		}
		return err
	}
	const writers, rounds = 4, 60
	var wg sync.WaitGroup
	errs := make(chan error, writers)
	for w := range writers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			p := bytes.Repeat([]byte{byte(w + 1)}, 4096)
			for r := range rounds {
				if _, err := l.WriteAt(p, int64(w*rounds+r)*4096); err != nil {
					errs <- err
					return
				}
				after := started.Load() // fsyncs that began before the write returned are not enough
				if err := l.Sync(); err != nil {
					errs <- err
					return
				}
				if doneMaxStart.Load() <= after {
					errs <- fmt.Errorf("writer %d round %d: Sync returned without an fsync begun after the write", w, r)
					return
				}
			}
		}()
	}
	// A syncer that never writes: its Syncs race with the writers' and must not make
	// theirs skip too early.
	stop := make(chan struct{})
	go func() {
		for {
			select {
			case <-stop:
				return
			default:
				_ = l.Sync()
			}
		}
	}()
	wg.Wait()
	close(stop)
	close(errs)
	for err := range errs {
		t.Fatal(err)
	}
}
