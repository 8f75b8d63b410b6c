package envd

import (
	"runtime/debug"
	"sync"
	"sync/atomic"
	"time"

	"github.com/aenv-dev/aenv/internal/lazygc"
)

// idleTrimmer returns freed memory to the OS once a burst of requests is over. It holds a
// timer only from a burst's first request until the burst is over: an idle envd (what a
// node holds by the thousand) has no timer pending, so neither its Go runtime's timer
// thread nor sysmon wakes (a 10 s ticker cost every idle envd ~0.3 wakeups and ~55 µs of
// CPU a second on a loaded host: the ticker's thread and sysmon, ~170 µs a wakeup).
type idleTrimmer struct {
	interval  time.Duration
	minGrowth int64
	requests  *atomic.Int64 // the server's request count
	trim      func()        // the trim (debug.FreeOSMemory); tests count it
	heap      func() int64  // bytes of heap objects, live or not (heapObjects)

	armed atomic.Bool // a timer is pending: requests need not arm one

	mu      sync.Mutex
	timer   *time.Timer
	seen    int64 // requests when the timer was last set
	base    int64 // heap objects after the last trim (or at the start)
	stopped bool
}

func newIdleTrimmer(interval time.Duration, minGrowth int64, requests *atomic.Int64) *idleTrimmer {
	t := &idleTrimmer{interval: interval, minGrowth: minGrowth, requests: requests, trim: debug.FreeOSMemory, heap: heapObjects}
	t.base = t.heap()
	return t
}

// poke is called on every request: it sets the timer when none is pending. It costs an
// atomic load while one is.
func (t *idleTrimmer) poke() {
	if t.armed.Load() || !t.armed.CompareAndSwap(false, true) {
		return
	}
	t.mu.Lock()
	defer t.mu.Unlock()
	if t.stopped {
		return
	}
	t.seen = t.requests.Load()
	if t.timer == nil {
		t.timer = time.AfterFunc(t.interval, t.fire)
		return
	}
	t.timer.Reset(t.interval)
}

// fire runs interval after the timer was set: a request since then means the burst goes
// on (wait another interval); none means it is over (trim when it left enough garbage,
// then hold no timer until the next request).
func (t *idleTrimmer) fire() {
	t.mu.Lock()
	if t.stopped {
		t.mu.Unlock()
		return
	}
	if n := t.requests.Load(); n != t.seen {
		t.seen = n
		t.timer.Reset(t.interval)
		t.mu.Unlock()
		return
	}
	if t.heap()-t.base >= t.minGrowth {
		t.trim()
		t.base = t.heap()
	}
	t.armed.Store(false)
	n := t.seen
	t.mu.Unlock()
	// A request between the count's read and the disarm saw the timer armed and did not
	// set it: set it for that one.
	if t.requests.Load() != n {
		t.poke()
	}
}

// stop stops the timer; pokes after it do nothing.
func (t *idleTrimmer) stop() {
	t.mu.Lock()
	defer t.mu.Unlock()
	t.stopped = true
	if t.timer != nil {
		t.timer.Stop()
	}
}

// heapObjects is the bytes of heap objects, live or not yet collected.
func heapObjects() int64 { return lazygc.RuntimeBytes("/memory/classes/heap/objects:bytes") }
