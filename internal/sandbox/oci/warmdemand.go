package oci

import (
	"cmp"
	"time"
)

// burstWindow: launches of one template that follow each other within this long count as
// one burst (a batch of rollouts asks for its sandboxes at once; a loop of sequential
// creates at full speed is a burst too).
const burstWindow = 2 * time.Second

// burstHold is how long a template's warm pool stays sized to its largest burst after the
// last launch that reached it.
const burstHold = 10 * time.Minute

// demand follows one template's launches to size its warm pool to its bursts.
type demand struct {
	recent []time.Time // launches within burstWindow of the newest, oldest first
	peak   int         // the largest burst that ended within burstHold
	peakAt time.Time   // the last launch that reached peak
}

// launched records a launch at now.
func (d *demand) launched(now time.Time) {
	i := 0
	for i < len(d.recent) && now.Sub(d.recent[i]) > burstWindow {
		i++
	}
	d.recent = append(d.recent[i:], now)
	if n := len(d.recent); n >= d.peak || now.Sub(d.peakAt) > burstHold {
		d.peak, d.peakAt = n, now
	}
}

// size is how many warm containers to keep at now: the largest recent burst, at least lo
// and at most hi.
func (d *demand) size(now time.Time, lo, hi int) int {
	n := lo
	if now.Sub(d.peakAt) <= burstHold {
		n = max(n, d.peak)
	}
	return min(n, hi)
}

// refillQuiet is how long after launches last overlapped the filler waits before growing
// a pool beyond its floor (warm_containers). A burst's launches and their first commands
// run in the ~0.3 s after it; refilled at once, the pool's new containers (runc, runc
// init, envd: ~50 ms of CPU each) took half of this 2-vCPU host from them (fork 16 → all
// answered 332 → 280 ms with the refill held back). Sequential launches never overlap, so
// a steady stream of creates has the filler working all along, as it needs (after
// refillDefer); an empty pool is refilled at once either way.
const refillQuiet = 200 * time.Millisecond

// refillDefer bounds how long a pool that is short but not empty waits for a pause in
// launches before it is refilled: a launch's caller sends its first command in the next
// few milliseconds, and a refill started at once (runc, runc init, envd: ~50 ms of CPU)
// ran beside the launch and that command, taking half of this 2-vCPU host from them
// (request → first command 25–26 → 14–15 ms of CPU). The filler waits while a launch runs
// and until refillDefer after the last one ended, but no longer than refillDefer after the
// pool fell short, so a stream of launches with no pause still has it working. An empty
// pool refills at once outside a burst (see refillBurstMax): the next launch would
// otherwise find no warm container.
const refillDefer = 100 * time.Millisecond

// refillBurstMax bounds how long a pool that a burst emptied, or took below its floor,
// waits for the burst to end. A burst's first commands run in the ~0.3 s after its
// launches; a refill started when the pool ran dry (runc, runc init, envd: ~50 ms of CPU
// per container) ran beside them. The bound keeps a load of launches that never stops
// overlapping from starving the pool.
const refillBurstMax = 300 * time.Millisecond

// target is how many warm containers key's pool keeps now (w.mu held).
func (w *warmPool) target(key string) int {
	d := w.demand[key]
	if d == nil {
		return w.size
	}
	return d.size(w.now(), w.size, w.maxSize)
}

// begin records a launch in progress until the returned function is called; launches
// that overlap make a burst, which holds back the pools' growth (see refillQuiet).
func (w *warmPool) begin() (end func()) {
	w.mu.Lock()
	w.inflight++
	if w.inflight > 1 {
		w.overlapped = w.now()
	}
	w.mu.Unlock()
	return func() {
		w.mu.Lock()
		w.ended = w.now()
		if w.inflight > 1 {
			w.overlapped = w.ended
		}
		w.inflight--
		w.mu.Unlock()
		w.kick()
	}
}

// needed returns a wanted template short of warm containers, or "". Outside a burst an
// empty pool comes first, at once; any other waits for a pause in launches (see
// refillDefer), and one that only lacks what a burst grew it to (below its target, not its
// floor) also until launches have not overlapped for refillQuiet. During a burst even an
// empty pool waits, at most refillBurstMax after the pools fell short (see there). While
// one waits, needed returns "" and how long is left. Roots in skip are passed over.
func (w *warmPool) needed(skip map[string]bool) (string, time.Duration) {
	w.mu.Lock()
	defer w.mu.Unlock()
	if w.closed {
		return "", 0
	}
	empty, low, grow := "", "", ""
	for _, l := range w.wanted {
		switch n := len(w.ready[l]); {
		case skip[l]:
		case n == 0 && w.size > 0:
			if empty == "" {
				empty = l
			}
		case n < w.size && low == "":
			low = l
		case n < w.target(l) && grow == "":
			grow = l
		}
	}
	now := w.now()
	if empty == "" && low == "" && grow == "" {
		w.short = time.Time{}
		return "", 0
	}
	if w.short.IsZero() {
		w.short = now
	}
	quiet := now.Sub(w.overlapped)
	if quiet < refillQuiet {
		if empty == "" && low == "" {
			return "", refillQuiet - quiet
		}
		if wait := min(refillQuiet-quiet, refillBurstMax-now.Sub(w.short)); wait > 0 {
			return "", wait
		}
		return cmp.Or(empty, low), 0
	}
	if empty != "" {
		return empty, 0
	}
	if wait := refillDefer - now.Sub(w.short); wait > 0 {
		if w.inflight > 0 {
			return "", wait // or the launch's end wakes the filler
		}
		if pause := refillDefer - now.Sub(w.ended); pause > 0 {
			return "", min(wait, pause)
		}
	}
	if low != "" {
		return low, 0
	}
	return grow, 0
}

// excess removes from the pools the containers beyond their template's target (a burst's
// that is now past) and returns them, to be discarded.
func (w *warmPool) excess() []*Instance {
	w.mu.Lock()
	defer w.mu.Unlock()
	var out []*Instance
	for l, q := range w.ready {
		if n := w.target(l); len(q) > n {
			out = append(out, q[n:]...)
			w.ready[l] = q[:n:n]
		}
	}
	return out
}
