package stack

import (
	"context"
	"errors"
	"fmt"
	"os"
	"strconv"
	"strings"
	"sync"
	"syscall"

	"github.com/aenv-dev/aenv/internal/storage/blob"
	"github.com/aenv-dev/aenv/internal/storage/lsmt"
	"github.com/aenv-dev/aenv/internal/storage/zfile"
)

// Lowers shares opened sealed layers between the stacks opened with it: a layer used by
// many stacks (every sandbox of one template opens the same ones) is opened once, its
// file, ZFile jump table and LSMT index held once, and closed when the last stack using
// it lets go. The merged index of a list of lowers is shared likewise, until a stack
// restacks or compacts (its merged index is then its own). Sealed layers are immutable,
// so a layer is known by its file (device, inode, size and modification time: hard links
// and renames share it, a file replaced at the same path does not) or, for a layer without
// a path, by its digest. The zero value is not usable; use NewLowers. Safe for concurrent
// use.
type Lowers struct {
	mu     sync.Mutex
	layers map[string]*sharedLayer
	merged map[string]*sharedMerged
	nextID uint64
	// cache, when set, keeps the compressed layers' decompressed blocks for all stacks.
	cache *zfile.BlockCache
}

// NewLowers returns an empty set.
func NewLowers() *Lowers {
	return &Lowers{layers: map[string]*sharedLayer{}, merged: map[string]*sharedMerged{}}
}

// NewLowersCached returns an empty set whose compressed layers keep their decompressed
// blocks in c, shared by every stack reading them.
func NewLowersCached(c *zfile.BlockCache) *Lowers {
	ls := NewLowers()
	ls.cache = c
	return ls
}

// CacheStats are the counters of the set's block cache (zero without one).
func (ls *Lowers) CacheStats() zfile.BlockCacheStats {
	if ls.cache == nil {
		return zfile.BlockCacheStats{}
	}
	return ls.cache.Stats()
}

// LowersStats are counts of what a Lowers holds open.
type LowersStats struct {
	// Layers is how many distinct layers are open, Refs how many stacks' lowers use them.
	Layers, Refs int
	// Merged is how many merged indexes are shared.
	Merged int
}

// Stats counts what is open.
func (ls *Lowers) Stats() LowersStats {
	ls.mu.Lock()
	defer ls.mu.Unlock()
	st := LowersStats{Layers: len(ls.layers), Merged: len(ls.merged)}
	for _, e := range ls.layers {
		st.Refs += e.refs
	}
	return st
}

// sharedLayer is one opened layer and the stacks' references to it.
type sharedLayer struct {
	key  string
	id   uint64
	refs int // guarded by Lowers.mu
	// ready is closed once the opener finished; l and src are set then unless err is.
	ready chan struct{}
	err   error
	l     *blob.Layer
	src   Source
}

type sharedMerged struct {
	idx  *lsmt.Index
	refs int
}

// layerKey names ref's layer among those open: its file's identity, or its digest.
func layerKey(path, digest string) (string, error) {
	if path == "" {
		return "digest:" + digest, nil
	}
	var st syscall.Stat_t
	if err := syscall.Stat(path, &st); err != nil {
		return "", fmt.Errorf("stack lower: %w", &os.PathError{Op: "stat", Path: path, Err: err})
	}
	return fileKey(&st), nil
}

func fileKey(st *syscall.Stat_t) string {
	return fmt.Sprintf("file:%d:%d:%d:%d.%d", st.Dev, st.Ino, st.Size, st.Mtim.Sec, st.Mtim.Nsec)
}

// acquire returns the layer at path (or, without a path, the one open by digest),
// opening it with open when no stack holds it.
func (ls *Lowers) acquire(ctx context.Context, path, digest string, open func(context.Context) (*blob.Layer, Source, error)) (*sharedLayer, error) {
	key, err := layerKey(path, digest)
	if err != nil {
		return nil, err
	}
	for try := 0; ; try++ {
		ls.mu.Lock()
		if e := ls.layers[key]; e != nil {
			e.refs++
			ls.mu.Unlock()
			<-e.ready
			if e.err == nil {
				return e, nil
			}
			ls.release(e)
			// The opener's own context ended: that is no reason to fail this open.
			if ctx.Err() == nil && try < 3 && (errors.Is(e.err, context.Canceled) || errors.Is(e.err, context.DeadlineExceeded)) {
				continue
			}
			return nil, e.err
		}
		ls.nextID++
		e := &sharedLayer{key: key, id: ls.nextID, refs: 1, ready: make(chan struct{})}
		ls.layers[key] = e
		ls.mu.Unlock()
		e.l, e.src, e.err = open(ctx)
		if e.err == nil && path != "" {
			if e.err = sameFile(e.src, key); e.err != nil {
				e.l.Close()
				e.src.Close()
				e.l, e.src = nil, nil
			}
		}
		if e.err != nil {
			// Out of the map before the waiters wake, so a retry opens anew.
			ls.mu.Lock()
			if ls.layers[key] == e {
				delete(ls.layers, key)
			}
			ls.mu.Unlock()
		}
		close(e.ready)
		if e.err != nil {
			ls.release(e)
			return nil, e.err
		}
		return e, nil
	}
}

// sameFile checks that src is the file key was made from: one replaced at its path
// between the stat and the open must not be shared under the old file's name.
func sameFile(src Source, key string) error {
	fs, ok := src.(*fileSource)
	if !ok {
		return nil
	}
	var st syscall.Stat_t
	if err := syscall.Fstat(int(fs.Fd()), &st); err != nil {
		return fmt.Errorf("stack lower: %w", err)
	}
	if fileKey(&st) != key {
		return fmt.Errorf("stack lower: %s changed while it was opened", fs.Name())
	}
	return nil
}

// release drops one reference to e, closing it with the last one.
func (ls *Lowers) release(e *sharedLayer) error {
	ls.mu.Lock()
	e.refs--
	last := e.refs == 0
	if last && ls.layers[e.key] == e {
		delete(ls.layers, e.key)
	}
	ls.mu.Unlock()
	if !last || e.l == nil {
		return nil
	}
	e.l.Close()
	return e.src.Close()
}

// mergedKey names a list of open layers (bottom first).
func mergedKey(ids []uint64) string {
	var b strings.Builder
	for _, id := range ids {
		b.WriteString(strconv.FormatUint(id, 36))
		b.WriteByte('.')
	}
	return b.String()
}

// acquireMerged returns the merged index of the layers with ids (bottom first), building
// it with build when no stack holds it.
func (ls *Lowers) acquireMerged(ids []uint64, build func() *lsmt.Index) (*lsmt.Index, string) {
	key := mergedKey(ids)
	ls.mu.Lock()
	if m := ls.merged[key]; m != nil {
		m.refs++
		ls.mu.Unlock()
		return m.idx, key
	}
	ls.mu.Unlock()
	// Built unlocked: two stacks racing build it twice and one copy is dropped.
	idx := build()
	ls.mu.Lock()
	defer ls.mu.Unlock()
	if m := ls.merged[key]; m != nil {
		m.refs++
		return m.idx, key
	}
	ls.merged[key] = &sharedMerged{idx: idx, refs: 1}
	return idx, key
}

func (ls *Lowers) releaseMerged(key string) {
	ls.mu.Lock()
	defer ls.mu.Unlock()
	m := ls.merged[key]
	if m == nil {
		return
	}
	if m.refs--; m.refs == 0 {
		delete(ls.merged, key)
	}
}
