package oci

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/aenv-dev/aenv/internal/sandbox"
)

// TestWarmPoolSizedToBurst: a burst of launches grows the template's pool to the burst's
// size (capped), launches after it are served warm, and the pool shrinks to its floor once
// the burst is older than burstHold.
func TestWarmPoolSizedToBurst(t *testing.T) {
	e := newTestBackend(t, func(c *Config) { c.WarmContainers, c.WarmContainersMax = 1, 3 })
	ctx := context.Background()
	// The pool's clock stands still, so however slow the host, the 4 launches are one
	// burst (the pool grows to the cap, 3) until it is moved past burstHold. It moves on by
	// refillDefer after launches, the pause the refill waits for.
	t0 := time.Now()
	setClock(e.b.warm, t0)
	for i := range 4 {
		e.launch(t, fmt.Sprintf("burst%d", i), sandbox.Resources{MemoryMB: 64})
	}
	setClock(e.b.warm, t0.Add(refillDefer))
	waitWarm(t, e.b, e.template, 3)

	i := e.launch(t, "fromwarm", sandbox.Resources{MemoryMB: 64})
	if !strings.HasPrefix(i.cid, "warm.") {
		t.Fatalf("launch after the burst did not use a warm container (cid %s)", i.cid)
	}
	setClock(e.b.warm, t0.Add(2*refillDefer))
	waitWarm(t, e.b, e.template, 3)

	setClock(e.b.warm, t0.Add(burstHold+time.Second))
	extra := e.b.warm.excess()
	if len(extra) != 2 {
		t.Fatalf("excess after the burst expired: %d containers, want 2", len(extra))
	}
	for _, w := range extra {
		e.b.warm.discard(w)
	}
	e.b.warm.mu.Lock()
	left := len(e.b.warm.ready[e.template])
	e.b.warm.mu.Unlock()
	if left != 1 {
		t.Fatalf("pool after trimming holds %d, want 1 (warm_containers)", left)
	}
	if err := i.Stop(ctx); err != nil {
		t.Fatal(err)
	}
}

// setClock stands w's clock still at now.
func setClock(w *warmPool, now time.Time) {
	w.mu.Lock()
	w.now = func() time.Time { return now }
	w.mu.Unlock()
}

// TestRefillWaitsForQuiet: the filler tops empty pools up at once, in the order they were
// wanted, and grows them to their bursts' size only after a pause in launches
// (refillDefer) and once launches stopped overlapping for refillQuiet. During a burst an
// empty pool waits too, at most refillBurstMax after it fell short.
func TestRefillWaitsForQuiet(t *testing.T) {
	t0 := time.Now()
	w := newWarmPool(nil, 1, 4)
	setClock(w, t0)
	for range 3 {
		w.begin()()
		w.want("a", createOpts{lower: "/a"})
	}
	w.want("b", createOpts{lower: "/b"})
	type want struct {
		key  string
		wait time.Duration
	}
	check := func(name string, now time.Duration, ready map[string]int, exp want) {
		t.Helper()
		setClock(w, t0.Add(now))
		w.mu.Lock()
		w.ready = map[string][]*Instance{}
		for k, n := range ready {
			w.ready[k] = make([]*Instance, n)
		}
		w.mu.Unlock()
		key, wait := w.needed(nil)
		if got := (want{key, wait}); got != exp {
			t.Errorf("%s: needed() = %+v, want %+v", name, got, exp)
		}
	}
	check("both below the floor: the last wanted first", 0, map[string]int{}, want{"b", 0})
	check("a below the floor", 0, map[string]int{"b": 1}, want{"a", 0})
	check("a short of its burst, a launch just ended", 0, map[string]int{"a": 1, "b": 1}, want{"", refillDefer})
	check("a short of its burst, sequential launches paused", refillDefer, map[string]int{"a": 1, "b": 1}, want{"a", 0})
	w.short = time.Time{}
	setClock(w, t0)

	// Two launches at once, the second ending at t0.
	end1 := w.begin()
	end2 := w.begin()
	end1()
	end2()
	check("a empty during a burst", 10*time.Millisecond, map[string]int{"b": 1}, want{"", refillQuiet - 10*time.Millisecond})
	check("a empty, the burst over", refillQuiet, map[string]int{"b": 1}, want{"a", 0})
	check("a short of its burst, 100 ms after the burst", 100*time.Millisecond, map[string]int{"a": 1, "b": 1}, want{"", refillQuiet - 100*time.Millisecond})
	check("a short of its burst, the burst over", refillQuiet, map[string]int{"a": 1, "b": 1}, want{"a", 0})
	check("all full", refillQuiet, map[string]int{"a": 3, "b": 1}, want{"", 0})

	// Launches that never stop overlapping hold an empty pool back no longer than
	// refillBurstMax after it fell short.
	overlap := func(at time.Duration) {
		setClock(w, t0.Add(at))
		end1, end2 := w.begin(), w.begin()
		end1()
		end2()
	}
	overlap(time.Second)
	check("a empty, launches overlapping", time.Second, map[string]int{"b": 1}, want{"", refillQuiet})
	overlap(time.Second + refillBurstMax)
	check("a empty, launches overlapping all along", time.Second+refillBurstMax, map[string]int{"b": 1}, want{"a", 0})

	setClock(w, t0.Add(10*time.Second))
	w.mu.Lock()
	w.ready = map[string][]*Instance{}
	w.mu.Unlock()
	if key, _ := w.needed(map[string]bool{"b": true}); key != "a" {
		t.Errorf("needed() with b failing = %q, want a", key)
	}
}

// TestRefillDefersToLaunches: a pool below its floor but not empty is refilled after a
// pause in launches (the launch's first command runs meanwhile), at most refillDefer
// after it fell short; an empty one at once, even while a launch runs.
func TestRefillDefersToLaunches(t *testing.T) {
	t0 := time.Now()
	w := newWarmPool(nil, 2, 2)
	setClock(w, t0)
	w.want("a", createOpts{lower: "/a"})
	w.ready = map[string][]*Instance{"a": make([]*Instance, 2)}
	at := func(d time.Duration) { setClock(w, t0.Add(d)) }
	check := func(name, key string, wait time.Duration) {
		t.Helper()
		if k, d := w.needed(nil); k != key || d != wait {
			t.Errorf("%s: needed() = %q, %v; want %q, %v", name, k, d, key, wait)
		}
	}
	check("full", "", 0)

	end := w.begin()
	w.ready["a"] = w.ready["a"][1:] // the launch took one
	check("a launch in flight", "", refillDefer)
	at(30 * time.Millisecond)
	end()
	check("the launch just ended", "", refillDefer-30*time.Millisecond)
	at(60 * time.Millisecond)
	check("30 ms after it ended", "", refillDefer-60*time.Millisecond)
	at(refillDefer)
	check("refillDefer after it fell short", "a", 0)

	// Launches that never pause hold the refill back no longer than refillDefer.
	w.ready["a"] = make([]*Instance, 2)
	check("full again", "", 0)
	at(time.Second)
	end = w.begin()
	w.ready["a"] = w.ready["a"][1:]
	check("fell short", "", refillDefer)
	at(time.Second + refillDefer)
	check("launching all along", "a", 0)
	w.ready["a"] = nil
	at(time.Second + refillDefer + time.Millisecond)
	end()
	end = w.begin()
	check("empty, a launch in flight", "a", 0)
	end()
}

// TestWantKeepsBlank: the least recently launched template goes beyond maxWarmTemplates;
// blank containers, which serve every template, are not one and stay.
func TestWantKeepsBlank(t *testing.T) {
	w := newWarmPool(nil, 1, 4)
	w.want(blankKey, createOpts{blank: true})
	for i := range maxWarmTemplates + 1 {
		w.want(fmt.Sprintf("/t%d", i), createOpts{lower: fmt.Sprintf("/t%d", i)})
	}
	want := []string{"/t4", "/t3", "/t2", "/t1", blankKey}
	if !slices.Equal(w.wanted, want) {
		t.Fatalf("wanted %v, want %v", w.wanted, want)
	}
	if _, ok := w.roots["/t0"]; ok {
		t.Fatal("the evicted template's root is still kept")
	}
}

// TestSnapshotTemplateWarm: creates from a snapshot template come from the warm pool like
// a template's, a fork's child (no SnapshotTemplate; it may take a blank container) never
// makes the pool keep its capture, and discarding the snapshot removes its warm
// containers. On overlay roots the warm containers open the capture's upper layers (they
// came up on an empty upper before createOpts.rootOnly).
func TestSnapshotTemplateWarm(t *testing.T) {
	for _, overlay := range []bool{false, true} {
		t.Run(fmt.Sprintf("overlay=%v", overlay), func(t *testing.T) { testSnapshotTemplateWarm(t, overlay) })
	}
}

func testSnapshotTemplateWarm(t *testing.T, overlay bool) {
	e := newTestBackend(t, func(c *Config) { c.WarmContainers, c.OverlayRoots = 1, overlay })
	ctx := context.Background()
	a := e.launchBlock(t, "st-a", testLayered(t), sandbox.Resources{})
	e.mustSh(t, a, "echo pinned > /root/state && sync -f / && cat /root/state")
	c, err := a.Snapshot(ctx)
	if err != nil {
		t.Fatal(err)
	}
	capd := c.(*Captured)
	if overlay != (len(capd.Upper) > 0) {
		t.Fatalf("overlay roots %v, capture's upper layers %v", overlay, capd.Upper)
	}
	key := blockKey(capd.Layers, fromUpperRefs(capd.Upper), capd.VirtualSize)
	wanted := func() bool {
		e.b.warm.mu.Lock()
		defer e.b.warm.mu.Unlock()
		_, ok := e.b.warm.roots[key]
		return ok
	}

	f := e.launchPlan(t, sandbox.LaunchPlan{Kind: sandbox.LaunchFromSnapshot, SandboxID: "st-fork", Snapshot: c})
	if wanted() {
		t.Fatalf("a fork's child (container %s) made the pool keep its capture warm", f.cid)
	}
	plan := func(id string) sandbox.LaunchPlan {
		return sandbox.LaunchPlan{Kind: sandbox.LaunchFromSnapshot, SandboxID: id, Snapshot: c, SnapshotTemplate: true}
	}
	k1 := e.launchPlan(t, plan("st-k1"))
	if !wanted() {
		t.Fatal("a create from a snapshot template did not make the pool keep it warm")
	}
	waitWarm(t, e.b, key, 1)
	k2 := e.launchPlan(t, plan("st-k2"))
	if !strings.HasPrefix(k2.cid, "warm.") {
		t.Fatalf("second create from the snapshot template: cid %s, not a warm container", k2.cid)
	}
	for _, k := range []*Instance{f, k1, k2} {
		if out := e.mustSh(t, k, "cat /root/state"); out != "pinned\n" {
			t.Fatalf("%s sees %q", k.id, out)
		}
	}
	waitWarm(t, e.b, key, 1)
	e.b.warm.mu.Lock()
	warm := e.b.warm.ready[key][0].cid
	e.b.warm.mu.Unlock()

	if err := e.b.DiscardSnapshot(ctx, c); err != nil {
		t.Fatal(err)
	}
	if wanted() {
		t.Fatal("discarded snapshot still kept warm")
	}
	// Its runtime state, not `runc list`: blank warm containers (wanted since the fork's
	// child) come and go meanwhile, and list fails on one deleted while it reads.
	if _, err := os.Stat(filepath.Join(e.b.rt.root, warm)); !errors.Is(err, os.ErrNotExist) {
		t.Fatalf("warm container %s of the discarded snapshot still exists (%v)", warm, err)
	}
	for _, i := range []*Instance{a, f, k1, k2} {
		if err := i.Stop(ctx); err != nil {
			t.Fatal(err)
		}
	}
}
