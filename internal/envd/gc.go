package envd

import (
	"math"
	"runtime"
	"runtime/debug"
	"runtime/metrics"
	"sync"
)

// LazyGC makes the Go collector run only when there is something to collect, for envd in a
// container, where every sandbox's envd is its own process and an idle one is what a node
// holds by the thousand. Go's default collector runs at least every two minutes (the
// runtime forces a cycle when none ran for that long), and an envd's first cycle leaves
// about 1.1 MiB resident that an envd that never collected does not have: mark bits, work
// buffers, the mark workers' stacks, metadata the sweep touches. So collection is off
// until the runtime's memory reaches limit (a soft memory limit), and TrimWhenIdle
// collects once a burst of requests left enough garbage to be worth it.
//
// A live heap near limit would make the runtime collect over and over, so a hook after
// every cycle switches to Go's default collector (GOGC=100, no limit) while the live heap
// is more than a quarter of limit, and back once it falls under an eighth.
type LazyGC struct {
	limit int64

	mu     sync.Mutex
	normal bool // Go's default collector (a large live heap)
	closed bool
}

// NewLazyGC turns collection off until the runtime's memory reaches limit bytes and
// installs the hook. limit <= 0 returns nil: Go's default collector.
func NewLazyGC(limit int64) *LazyGC {
	if limit <= 0 {
		return nil
	}
	g := &LazyGC{limit: limit}
	g.apply(false)
	g.arm()
	return g
}

// arm makes afterGC run once the next cycle has found a fresh sentinel unreachable.
func (g *LazyGC) arm() {
	s := new([16]byte) // large enough not to be a tiny allocation (those share finalizers)
	runtime.SetFinalizer(s, func(*[16]byte) { g.afterGC() })
}

func (g *LazyGC) afterGC() {
	live := liveHeap()
	g.mu.Lock()
	if g.closed {
		g.mu.Unlock()
		return
	}
	switch {
	case !g.normal && live > g.limit/4:
		g.apply(true)
	case g.normal && live < g.limit/8:
		g.apply(false)
	}
	g.mu.Unlock()
	g.arm()
}

// apply sets the collector: the default one (normal) or off until the limit.
func (g *LazyGC) apply(normal bool) {
	g.normal = normal
	if normal {
		debug.SetMemoryLimit(math.MaxInt64)
		debug.SetGCPercent(100)
		return
	}
	debug.SetMemoryLimit(g.limit)
	debug.SetGCPercent(-1)
}

// Close restores Go's default collector and removes the hook (at its next cycle).
func (g *LazyGC) Close() {
	g.mu.Lock()
	defer g.mu.Unlock()
	g.closed = true
	g.apply(true)
}

// Normal reports whether the default collector is in use (the live heap was large).
func (g *LazyGC) Normal() bool {
	g.mu.Lock()
	defer g.mu.Unlock()
	return g.normal
}

// liveHeap is the heap the last cycle found live (0 before the first).
func liveHeap() int64 {
	s := []metrics.Sample{{Name: "/gc/heap/live:bytes"}}
	metrics.Read(s)
	if s[0].Value.Kind() != metrics.KindUint64 {
		return 0
	}
	return int64(s[0].Value.Uint64())
}

// heapObjects is the bytes of heap objects, live or not yet collected.
func heapObjects() int64 {
	s := []metrics.Sample{{Name: "/memory/classes/heap/objects:bytes"}}
	metrics.Read(s)
	if s[0].Value.Kind() != metrics.KindUint64 {
		return 0
	}
	return int64(s[0].Value.Uint64())
}
