package zfile

import (
	"container/list"
	"sync"
)

// BlockCache keeps decompressed blocks of the Readers that use it (see Reader.UseCache),
// least recently used first out, within a budget of bytes. It is for layers many readers
// share: every sandbox of a template reads the same blocks of its layers as it mounts
// its root and starts its first processes, and without it each of them decompressed
// them again. Safe for concurrent use.
type BlockCache struct {
	mu     sync.Mutex
	max    int64
	size   int64
	lru    *list.List // of *cached, most recently used at the front
	blocks map[cacheKey]*list.Element
	nextID uint64

	hits, misses uint64
}

type cacheKey struct {
	reader uint64 // the Reader's id in this cache
	block  int
}

type cached struct {
	key  cacheKey
	data []byte // never written after it is stored: readers copy from it unlocked
}

// NewBlockCache returns an empty cache holding at most maxBytes of blocks.
func NewBlockCache(maxBytes int64) *BlockCache {
	return &BlockCache{max: maxBytes, lru: list.New(), blocks: map[cacheKey]*list.Element{}}
}

// BlockCacheStats are a cache's counters.
type BlockCacheStats struct {
	Bytes  int64  `json:"bytes"`
	Blocks int    `json:"blocks"`
	Hits   uint64 `json:"hits"`
	Misses uint64 `json:"misses"`
}

// Stats returns the cache's counters.
func (c *BlockCache) Stats() BlockCacheStats {
	c.mu.Lock()
	defer c.mu.Unlock()
	return BlockCacheStats{Bytes: c.size, Blocks: len(c.blocks), Hits: c.hits, Misses: c.misses}
}

// id names a new reader in the cache.
func (c *BlockCache) id() uint64 {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.nextID++
	return c.nextID
}

// get returns block b of reader r; the slice must not be written.
func (c *BlockCache) get(r uint64, b int) ([]byte, bool) {
	c.mu.Lock()
	defer c.mu.Unlock()
	e, ok := c.blocks[cacheKey{r, b}]
	if !ok {
		c.misses++
		return nil, false
	}
	c.hits++
	c.lru.MoveToFront(e)
	return e.Value.(*cached).data, true
}

// has reports whether block b of reader r is cached, without counting it as a use.
func (c *BlockCache) has(r uint64, b int) bool {
	c.mu.Lock()
	defer c.mu.Unlock()
	_, ok := c.blocks[cacheKey{r, b}]
	return ok
}

// add stores a copy of data as block b of reader r.
func (c *BlockCache) add(r uint64, b int, data []byte) {
	if int64(len(data)) > c.max {
		return
	}
	cp := append([]byte(nil), data...)
	c.mu.Lock()
	defer c.mu.Unlock()
	k := cacheKey{r, b}
	if _, ok := c.blocks[k]; ok {
		return // another reader decoded it meanwhile
	}
	c.blocks[k] = c.lru.PushFront(&cached{key: k, data: cp})
	c.size += int64(len(cp))
	for c.size > c.max {
		last := c.lru.Back()
		old := c.lru.Remove(last).(*cached)
		delete(c.blocks, old.key)
		c.size -= int64(len(old.data))
	}
}

// drop removes every block of reader r (it was closed).
func (c *BlockCache) drop(r uint64) {
	c.mu.Lock()
	defer c.mu.Unlock()
	for e := c.lru.Front(); e != nil; {
		next := e.Next()
		if v := e.Value.(*cached); v.key.reader == r {
			c.lru.Remove(e)
			delete(c.blocks, v.key)
			c.size -= int64(len(v.data))
		}
		e = next
	}
}
