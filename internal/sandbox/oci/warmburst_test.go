package oci

import (
	"context"
	"fmt"
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
	// burst (the pool grows to the cap, 3) until it is moved past burstHold.
	t0 := time.Now()
	e.b.warm.mu.Lock()
	e.b.warm.now = func() time.Time { return t0 }
	e.b.warm.mu.Unlock()
	for i := range 4 {
		e.launch(t, fmt.Sprintf("burst%d", i), sandbox.Resources{MemoryMB: 64})
	}
	waitWarm(t, e.b, e.template, 3)

	i := e.launch(t, "fromwarm", sandbox.Resources{MemoryMB: 64})
	if !strings.HasPrefix(i.cid, "warm.") {
		t.Fatalf("launch after the burst did not use a warm container (cid %s)", i.cid)
	}
	waitWarm(t, e.b, e.template, 3)

	e.b.warm.mu.Lock()
	e.b.warm.now = func() time.Time { return t0.Add(burstHold + time.Second) }
	e.b.warm.mu.Unlock()
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
