package steptime

import (
	"log/slog"
	"testing"
	"time"
)

func TestLaps(t *testing.T) {
	l := Start()
	deadline := time.Now().Add(20 * time.Millisecond)
	for time.Now().Before(deadline) { // burn CPU in the first step
	}
	l.Lap("busy")
	time.Sleep(20 * time.Millisecond)
	l.Lap("idle")
	attrs := l.Attrs()
	if len(attrs) != 2 {
		t.Fatalf("got %d attrs, want 2", len(attrs))
	}
	got := map[string]map[string]time.Duration{}
	for _, a := range attrs {
		g := a.(slog.Attr)
		got[g.Key] = map[string]time.Duration{}
		for _, s := range g.Value.Group() {
			got[g.Key][s.Key] = s.Value.Duration()
		}
	}
	if got["busy"]["wall"] < 20*time.Millisecond || got["idle"]["wall"] < 20*time.Millisecond {
		t.Errorf("wall times %v: each step lasted at least 20ms", got)
	}
	// CPU time is counted in clock ticks on some kernels: only its order is checked.
	if got["busy"]["cpu"] == 0 {
		t.Errorf("busy step used no CPU: %v", got)
	}
	if got["idle"]["cpu"] > got["busy"]["cpu"] {
		t.Errorf("the sleeping step used more CPU than the busy one: %v", got)
	}
}
