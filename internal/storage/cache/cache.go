// Package cache is a bounded on-disk block cache in front of lazy remote
// sources: reads fetch only the blocks they touch, blocks are stored as
// files with per-page CRC32C, least recently used blocks are evicted between
// a high and a low watermark, the cache survives restarts, and concurrent
// misses on one block fetch it once.
package cache

import (
	"container/list"
	"context"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"io/fs"
	"log/slog"
	"os"
	"path/filepath"
	"sort"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"golang.org/x/sync/singleflight"
)

// Source is a lazily fetched blob. ReadAt must fill p completely unless the
// range passes Size.
type Source interface {
	ReadAt(ctx context.Context, p []byte, off int64) (int, error)
	Size() int64
}

// Options configure a Cache.
type Options struct {
	Dir       string
	MaxBytes  int64   // capacity; required
	BlockSize int64   // fetch granularity, power of two ≥ 4 KiB; default 1 MiB
	HighWater float64 // evict when usage exceeds this fraction of MaxBytes (default 0.9)
	LowWater  float64 // ... down to this fraction (default 0.8)
	// Readahead is how many blocks past k (k+1 .. k+Readahead) are fetched
	// in the background when blocks k-1 and k of one file are read in order;
	// 0 fetches none. Prefetch alone means a readahead of one block.
	Readahead int
	Prefetch  bool
}

// Stats are cumulative counters.
type Stats struct {
	Hits, Misses, FetchedBytes, ReadBytes, Evictions, Corrupt int64
	// VerifyFailures counts fetched chunks that did not match their
	// published hash (see Sums).
	VerifyFailures int64
	UsedBytes      int64
}

// ErrCorrupt marks a cached block whose CRC does not match; the block is
// dropped and refetched transparently, so callers only see it from Verify.
var ErrCorrupt = errors.New("cache: corrupt block")

// Cache is safe for concurrent use.
type Cache struct {
	o      Options
	flight singleflight.Group

	mu    sync.Mutex
	lru   *list.List // front = most recent; values are *entry
	items map[string]*list.Element
	used  int64

	hits, misses, fetched, read, evictions, corrupt, verifyFailures atomic.Int64
	prefetchSem                                                     chan struct{}
	prefetches                                                      sync.WaitGroup
}

// Close waits for background prefetches to finish. Cached blocks stay on
// disk for the next Open.
func (c *Cache) Close() error {
	c.prefetches.Wait()
	return nil
}

type entry struct {
	name    string // relative path: <keyhash>/<block>
	size    int64
	touched time.Time
}

// Open opens (or creates) a cache directory and indexes what a previous run
// left in it; temporary files from interrupted fetches are removed.
func Open(o Options) (*Cache, error) {
	if o.MaxBytes <= 0 {
		return nil, fmt.Errorf("cache: MaxBytes must be positive")
	}
	if o.BlockSize == 0 {
		o.BlockSize = 1 << 20
	}
	if o.BlockSize < pageSize || o.BlockSize&(o.BlockSize-1) != 0 {
		return nil, fmt.Errorf("cache: block size %d not a power of two ≥ %d", o.BlockSize, pageSize)
	}
	if o.Readahead < 0 {
		return nil, fmt.Errorf("cache: negative readahead %d", o.Readahead)
	}
	if o.Prefetch && o.Readahead == 0 {
		o.Readahead = 1
	}
	if o.HighWater == 0 {
		o.HighWater = 0.9
	}
	if o.LowWater == 0 {
		o.LowWater = 0.8
	}
	if !(0 < o.LowWater && o.LowWater <= o.HighWater && o.HighWater <= 1) {
		return nil, fmt.Errorf("cache: watermarks low %.2f high %.2f invalid", o.LowWater, o.HighWater)
	}
	if err := os.MkdirAll(o.Dir, 0o755); err != nil {
		return nil, fmt.Errorf("cache: %w", err)
	}
	c := &Cache{o: o, lru: list.New(), items: map[string]*list.Element{}, prefetchSem: make(chan struct{}, max(4, o.Readahead))}
	if err := c.load(); err != nil {
		return nil, err
	}
	c.mu.Lock()
	c.evictLocked()
	c.mu.Unlock()
	return c, nil
}

func (c *Cache) load() error {
	var found []*entry
	err := filepath.WalkDir(c.o.Dir, func(p string, d fs.DirEntry, err error) error {
		if err != nil || d.IsDir() {
			return err
		}
		rel, _ := filepath.Rel(c.o.Dir, p)
		if strings.Contains(d.Name(), ".tmp") {
			os.Remove(p)
			return nil
		}
		if _, perr := strconv.ParseInt(d.Name(), 10, 64); perr != nil || strings.Count(rel, string(filepath.Separator)) != 1 {
			return nil // not ours
		}
		info, err := d.Info()
		if err != nil {
			return nil
		}
		found = append(found, &entry{name: rel, size: info.Size(), touched: info.ModTime()})
		return nil
	})
	if err != nil {
		return fmt.Errorf("cache: scan %s: %w", c.o.Dir, err)
	}
	// Oldest first, so pushing to the front leaves the newest at the front.
	sort.Slice(found, func(i, j int) bool { return found[i].touched.Before(found[j].touched) })
	for _, e := range found {
		c.items[e.name] = c.lru.PushFront(e)
		c.used += e.size
	}
	return nil
}

// Stats returns the counters.
func (c *Cache) Stats() Stats {
	c.mu.Lock()
	used := c.used
	c.mu.Unlock()
	return Stats{Hits: c.hits.Load(), Misses: c.misses.Load(), FetchedBytes: c.fetched.Load(),
		ReadBytes: c.read.Load(), Evictions: c.evictions.Load(), Corrupt: c.corrupt.Load(),
		VerifyFailures: c.verifyFailures.Load(), UsedBytes: used}
}

// File returns a cached view of src. key must identify src's content (a
// digest, or a URL whose content never changes).
func (c *Cache) File(key string, src Source) *File {
	h := sha256.Sum256([]byte(key))
	return &File{c: c, key: key, dir: hex.EncodeToString(h[:16]), src: src, size: src.Size(), last: -2}
}

// touch marks a block used, adding it if new, and evicts when over the high
// watermark.
func (c *Cache) touch(name string, size int64, isNew bool) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if el, ok := c.items[name]; ok {
		c.lru.MoveToFront(el)
		e := el.Value.(*entry)
		if now := time.Now(); now.Sub(e.touched) > time.Minute {
			// Persist recency for the next start, at most once a minute.
			e.touched = now
			_ = os.Chtimes(filepath.Join(c.o.Dir, name), now, now)
		}
		return
	}
	if !isNew {
		return
	}
	c.items[name] = c.lru.PushFront(&entry{name: name, size: size, touched: time.Now()})
	c.used += size
	if float64(c.used) > c.o.HighWater*float64(c.o.MaxBytes) {
		c.evictLocked()
	}
}

func (c *Cache) evictLocked() {
	low := int64(c.o.LowWater * float64(c.o.MaxBytes))
	if float64(c.used) <= c.o.HighWater*float64(c.o.MaxBytes) {
		return
	}
	for c.used > low && c.lru.Len() > 0 {
		c.removeLocked(c.lru.Back())
		c.evictions.Add(1)
	}
}

func (c *Cache) removeLocked(el *list.Element) {
	e := el.Value.(*entry)
	c.lru.Remove(el)
	delete(c.items, e.name)
	c.used -= e.size
	// Readers holding the file open keep reading it; unlink is safe.
	if err := os.Remove(filepath.Join(c.o.Dir, e.name)); err != nil && !os.IsNotExist(err) {
		slog.Warn("cache: remove block", "block", e.name, "err", err)
	}
}

func (c *Cache) has(name string) bool {
	c.mu.Lock()
	defer c.mu.Unlock()
	_, ok := c.items[name]
	return ok
}

func (c *Cache) drop(name string) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if el, ok := c.items[name]; ok {
		c.removeLocked(el)
	} else {
		os.Remove(filepath.Join(c.o.Dir, name))
	}
}
