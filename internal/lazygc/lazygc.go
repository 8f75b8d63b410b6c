// Package lazygc runs Go's garbage collector only when there is something worth
// collecting: off until the runtime's memory reaches a floor, and Go's default collector
// while the live heap is large. For processes whose heap is small and whose garbage comes
// in bursts: envd in a container, where an idle one is what a node holds by the thousand
// and a collection leaves memory resident, and the node, whose few MiB of live heap made
// the default collector run every few MiB of allocation, twice per fork of 16.
package lazygc

import (
	"math"
	"runtime"
	"runtime/debug"
	"runtime/metrics"
	"sync"
)

// GC is the policy installed by New. Go's default collector runs at least every two
// minutes (the runtime forces a cycle when none ran for that long) and whenever the heap
// doubled; with GC, collection is off until the runtime's memory reaches limit (a soft
// memory limit). An envd's first cycle leaves about 1.1 MiB resident that an envd that
// never collected does not have (mark bits, work buffers, the mark workers' stacks,
// metadata the sweep touches).
//
// A live heap near limit would make the runtime collect over and over, so a hook after
// every cycle switches to Go's default collector (GOGC=100, no limit) while the live heap
// is more than a quarter of limit, and back once it falls under an eighth.
type GC struct {
	limit int64

	mu     sync.Mutex
	normal bool // Go's default collector (a large live heap)
	closed bool
}

// New turns collection off until the runtime's memory reaches limit bytes and installs
// the hook. limit <= 0 returns nil: Go's default collector.
func New(limit int64) *GC {
	if limit <= 0 {
		return nil
	}
	g := &GC{limit: limit}
	g.apply(false)
	g.arm()
	return g
}

// arm makes afterGC run once the next cycle has found a fresh sentinel unreachable.
func (g *GC) arm() {
	s := new([16]byte) // large enough not to be a tiny allocation (those share finalizers)
	runtime.SetFinalizer(s, func(*[16]byte) { g.afterGC() })
}

func (g *GC) afterGC() {
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
func (g *GC) apply(normal bool) {
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
func (g *GC) Close() {
	g.mu.Lock()
	defer g.mu.Unlock()
	g.closed = true
	g.apply(true)
}

// Normal reports whether the default collector is in use (the live heap was large).
func (g *GC) Normal() bool {
	g.mu.Lock()
	defer g.mu.Unlock()
	return g.normal
}

// liveHeap is the heap the last cycle found live (0 before the first).
func liveHeap() int64 { return RuntimeBytes("/gc/heap/live:bytes") }

// RuntimeBytes reads one of runtime/metrics' byte counts, 0 when this Go has no such
// metric.
func RuntimeBytes(name string) int64 {
	s := []metrics.Sample{{Name: name}}
	metrics.Read(s)
	if s[0].Value.Kind() != metrics.KindUint64 {
		return 0
	}
	return int64(s[0].Value.Uint64())
}
