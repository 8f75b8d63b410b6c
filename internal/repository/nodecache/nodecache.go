// Package nodecache keeps node-local copies of blobs from a shared (remote)
// repository: bounded by size, least recently used blobs evicted between a
// high and a low watermark, blobs pinned by live or paused sandboxes or by
// publications in flight never evicted, the index rebuilt from disk on
// restart with every blob's digest re-checked before its first use, and
// concurrent fetches of one blob made once.
//
// A Cache is itself a repository.Repository: records and GC pass through to
// the remote, blob reads are served locally when cached (fetched whole, or
// read as lazy ranges from the remote when the blob is not cached and
// FetchOnOpen is off), and PutBlob writes the local copy then the remote one.
// PutLocal and Publish split that for snapshots, which must be usable on
// this node before their upload ends.
//
// Layout under Dir:
//
//	blobs/sha256/<hex>   verified copies; mtime = last access (LRU across restarts)
//	pins/<owner>.json    {"digests": [...]} per pin owner (sandbox, publication)
//	tmp/                 fetches in flight; emptied by Open
package nodecache

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"path/filepath"
	"sort"
	"sync"
	"sync/atomic"
	"time"

	"golang.org/x/sync/singleflight"

	"github.com/aenv-dev/aenv/internal/repository"
)

// ErrCacheFull: the blob does not fit even after evicting everything that
// is neither pinned nor open.
var ErrCacheFull = errors.New("nodecache: full")

// Options configure a Cache.
type Options struct {
	Dir      string
	MaxBytes int64 // capacity; required
	// HighWater and LowWater are fractions of MaxBytes: eviction starts above
	// high and stops at low (defaults 0.9 and 0.7).
	HighWater, LowWater float64
	// FetchOnOpen makes OpenBlob copy a missing blob whole before reading it;
	// otherwise OpenBlob reads ranges from the remote until Fetch is called.
	FetchOnOpen bool
	// VerifyOnOpen re-hashes every cached blob in Open instead of before each
	// blob's first use.
	VerifyOnOpen bool
	Logger       *slog.Logger
}

// Stats are counters since Open plus the current size.
type Stats struct {
	Entries, UsedBytes                              int64
	Hits, Misses, Fetches, FetchedBytes, Evictions  int64
	Corrupt, RemoteReads, PublishedBlobs, PinOwners int64
}

type entry struct {
	size     int64
	access   time.Time // last use, in memory
	stamped  time.Time // last access persisted as mtime
	verified bool
	open     int // readers and publications using the file
}

// Cache is safe for concurrent use by one process; two processes must not
// share a Dir.
type Cache struct {
	remote repository.Repository
	o      Options
	log    *slog.Logger
	flight singleflight.Group

	mu       sync.Mutex
	entries  map[repository.Digest]*entry
	used     int64 // bytes of entries plus reservations for fetches in flight
	pins     map[string][]repository.Digest
	pinCount map[repository.Digest]int

	hits, misses, fetches, fetched, evictions, corrupt, remoteReads, published atomic.Int64
}

var _ repository.Repository = (*Cache)(nil)

// Open opens (or creates) the cache directory in front of remote.
func Open(ctx context.Context, remote repository.Repository, o Options) (*Cache, error) {
	if o.MaxBytes <= 0 {
		return nil, fmt.Errorf("%w: nodecache MaxBytes must be positive", repository.ErrInvalid)
	}
	if o.HighWater == 0 {
		o.HighWater = 0.9
	}
	if o.LowWater == 0 {
		o.LowWater = 0.7
	}
	if !(0 < o.LowWater && o.LowWater <= o.HighWater && o.HighWater <= 1) {
		return nil, fmt.Errorf("%w: nodecache watermarks low %.2f high %.2f", repository.ErrInvalid, o.LowWater, o.HighWater)
	}
	if o.Logger == nil {
		o.Logger = slog.Default()
	}
	c := &Cache{remote: remote, o: o, log: o.Logger, entries: map[repository.Digest]*entry{},
		pins: map[string][]repository.Digest{}, pinCount: map[repository.Digest]int{}}
	if err := os.RemoveAll(c.path("tmp")); err != nil {
		return nil, fmt.Errorf("nodecache: %w", err)
	}
	for _, d := range []string{c.path("blobs", "sha256"), c.path("pins"), c.path("tmp")} {
		if err := os.MkdirAll(d, 0o755); err != nil {
			return nil, fmt.Errorf("nodecache: %w", err)
		}
	}
	if err := c.loadIndex(); err != nil {
		return nil, err
	}
	if err := c.loadPins(); err != nil {
		return nil, err
	}
	if o.VerifyOnOpen {
		if err := c.Verify(ctx); err != nil {
			return nil, err
		}
	}
	c.mu.Lock()
	c.evictLocked(c.highBytes())
	c.mu.Unlock()
	return c, nil
}

func (c *Cache) path(elem ...string) string {
	return filepath.Join(append([]string{c.o.Dir}, elem...)...)
}

func (c *Cache) blobPath(d repository.Digest) string { return c.path("blobs", "sha256", d.Hex()) }

func (c *Cache) highBytes() int64 { return int64(float64(c.o.MaxBytes) * c.o.HighWater) }
func (c *Cache) lowBytes() int64  { return int64(float64(c.o.MaxBytes) * c.o.LowWater) }

// loadIndex rebuilds the index from the files; they are unverified until
// first used (or Verify).
func (c *Cache) loadIndex() error {
	ents, err := os.ReadDir(c.path("blobs", "sha256"))
	if err != nil {
		return fmt.Errorf("nodecache: %w", err)
	}
	for _, e := range ents {
		d := repository.Digest("sha256:" + e.Name())
		info, err := e.Info()
		if d.Validate() != nil || err != nil || !info.Mode().IsRegular() {
			os.RemoveAll(c.path("blobs", "sha256", e.Name()))
			continue
		}
		c.entries[d] = &entry{size: info.Size(), access: info.ModTime(), stamped: info.ModTime()}
		c.used += info.Size()
	}
	return nil
}

// Stats reports counters.
func (c *Cache) Stats() Stats {
	c.mu.Lock()
	s := Stats{Entries: int64(len(c.entries)), PinOwners: int64(len(c.pins))}
	for _, e := range c.entries {
		s.UsedBytes += e.size
	}
	c.mu.Unlock()
	s.Hits, s.Misses, s.Fetches, s.FetchedBytes = c.hits.Load(), c.misses.Load(), c.fetches.Load(), c.fetched.Load()
	s.Evictions, s.Corrupt, s.RemoteReads, s.PublishedBlobs = c.evictions.Load(), c.corrupt.Load(), c.remoteReads.Load(), c.published.Load()
	return s
}

// Cached reports whether d has a local copy.
func (c *Cache) Cached(d repository.Digest) bool {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.entries[d] != nil
}

// reserve makes room for n more bytes: past the high watermark it evicts
// until usage plus n is at the low watermark. It fails with ErrCacheFull
// when pins and open files leave too little evictable.
func (c *Cache) reserve(d repository.Digest, n int64) error {
	c.mu.Lock()
	defer c.mu.Unlock()
	if n > c.o.MaxBytes {
		return fmt.Errorf("%w: blob %s of %d bytes exceeds the capacity %d", ErrCacheFull, d, n, c.o.MaxBytes)
	}
	if c.used+n > c.highBytes() {
		c.evictLocked(max(c.lowBytes()-n, 0))
	}
	if c.used+n > c.o.MaxBytes {
		return fmt.Errorf("%w: %d bytes needed for %s, %d of %d in use by pinned or open blobs", ErrCacheFull, n, d, c.used, c.o.MaxBytes)
	}
	c.used += n
	return nil
}

func (c *Cache) unreserve(n int64) {
	c.mu.Lock()
	c.used -= n
	c.mu.Unlock()
}

// evictLocked removes least recently used blobs that are neither pinned nor
// open until usage is at most target.
func (c *Cache) evictLocked(target int64) {
	if c.used <= target {
		return
	}
	type cand struct {
		d repository.Digest
		e *entry
	}
	var cands []cand
	for d, e := range c.entries {
		if e.open == 0 && c.pinCount[d] == 0 {
			cands = append(cands, cand{d, e})
		}
	}
	sort.Slice(cands, func(i, j int) bool { return cands[i].e.access.Before(cands[j].e.access) })
	for _, k := range cands {
		if c.used <= target {
			return
		}
		if err := os.Remove(c.blobPath(k.d)); err != nil && !errors.Is(err, os.ErrNotExist) {
			c.log.Warn("nodecache: evict", "digest", k.d, "err", err)
			continue
		}
		delete(c.entries, k.d)
		c.used -= k.e.size
		c.evictions.Add(1)
		c.log.Debug("nodecache: evicted", "digest", k.d, "size", k.e.size)
	}
}

// dropLocked forgets an entry whose file is bad or gone.
func (c *Cache) dropLocked(d repository.Digest) {
	if e := c.entries[d]; e != nil {
		os.Remove(c.blobPath(d))
		delete(c.entries, d)
		c.used -= e.size
	}
}

// touchLocked records a use; the mtime is rewritten at most once a minute
// so that LRU order survives a restart without a metadata write per read.
func (c *Cache) touchLocked(d repository.Digest, e *entry) {
	now := time.Now()
	e.access = now
	if now.Sub(e.stamped) > time.Minute {
		e.stamped = now
		_ = os.Chtimes(c.blobPath(d), now, now)
	}
}
