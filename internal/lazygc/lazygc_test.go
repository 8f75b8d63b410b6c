package lazygc

import (
	"math"
	"runtime"
	"runtime/debug"
	"testing"
	"time"
)

// restoreGC puts Go's default collector back after a test that changed it.
func restoreGC(t *testing.T) {
	t.Cleanup(func() {
		debug.SetGCPercent(100)
		debug.SetMemoryLimit(math.MaxInt64)
	})
}

func gcSettings() (percent int, limit int64) {
	percent = debug.SetGCPercent(-1)
	debug.SetGCPercent(percent)
	return percent, debug.SetMemoryLimit(-1) // a negative limit only reads it
}

// waitNormal runs collections until the hook has seen one and says want.
func waitNormal(t *testing.T, g *GC, want bool) {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for g.Normal() != want {
		if time.Now().After(deadline) {
			t.Fatalf("Normal() stayed %v after collections (live heap %d)", !want, liveHeap())
		}
		runtime.GC()
		time.Sleep(10 * time.Millisecond)
	}
}

var sink []byte

func TestLazyGC(t *testing.T) {
	restoreGC(t)
	if New(0) != nil {
		t.Fatal("New(0) is not nil: it must leave Go's default collector")
	}
	const limit = 32 << 20
	g := New(limit)
	if p, l := gcSettings(); p != -1 || l != limit {
		t.Fatalf("after New: GOGC %d, limit %d; want off and %d", p, l, limit)
	}
	// A live heap above a quarter of the limit: the default collector, no limit.
	sink = make([]byte, limit/2)
	for i := range sink {
		sink[i] = 1
	}
	waitNormal(t, g, true)
	if p, l := gcSettings(); p != 100 || l != math.MaxInt64 {
		t.Fatalf("with a large live heap: GOGC %d, limit %d; want 100 and none", p, l)
	}
	// Back under an eighth: off again.
	sink = nil
	waitNormal(t, g, false)
	if p, l := gcSettings(); p != -1 || l != limit {
		t.Fatalf("after the heap shrank: GOGC %d, limit %d; want off and %d", p, l, limit)
	}
	g.Close()
	if p, _ := gcSettings(); p != 100 {
		t.Fatalf("after Close: GOGC %d, want 100", p)
	}
}
