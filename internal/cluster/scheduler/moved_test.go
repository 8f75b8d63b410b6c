package scheduler

import (
	"testing"
	"time"

	pb "github.com/aenv-dev/aenv/internal/cluster/scheduler/gen/schedulerv1"
)

// A sandbox resumed on node b from node a's published pause stays bound to b while a,
// until it notices, still reports it paused; a's report wins again once b is stale, and a
// running report always wins.
func TestPausedReportDoesNotTakeAMovedSandboxBack(t *testing.T) {
	s, c := newTestState(t)
	beat(t, s, hb{id: "a", cpu: 8, mem: 8192}, hb{id: "b", cpu: 8, mem: 8192})
	pausedOnA := hb{id: "a", cpu: 8, mem: 8192}.req()
	pausedOnA.Sandboxes = []*pb.SandboxReport{{Id: "sb", State: "paused"}}
	if err := s.Heartbeat(pausedOnA); err != nil {
		t.Fatal(err)
	}
	if err := s.Bind("sb", "b", ""); err != nil {
		t.Fatal(err)
	}
	lookup := func() string {
		t.Helper()
		l, err := s.Lookup("sb")
		if err != nil {
			t.Fatal(err)
		}
		return l.Node.Id
	}
	for _, tc := range []struct {
		name  string
		setup func()
		want  string
	}{
		{"a reports it paused, b is fresh", func() {
			if err := s.Heartbeat(pausedOnA); err != nil {
				t.Fatal(err)
			}
		}, "b"},
		{"b lists it running", func() { beat(t, s, hb{id: "b", cpu: 8, mem: 8192, sandboxes: []string{"sb"}}) }, "b"},
		{"b goes stale, a still reports it paused", func() {
			c.advance(6 * time.Second)
			if err := s.Heartbeat(pausedOnA); err != nil {
				t.Fatal(err)
			}
		}, "a"},
		{"b is back listing it running", func() { beat(t, s, hb{id: "b", cpu: 8, mem: 8192, sandboxes: []string{"sb"}}) }, "b"},
	} {
		tc.setup()
		if got := lookup(); got != tc.want {
			t.Fatalf("%s: bound to %s, want %s", tc.name, got, tc.want)
		}
	}
}
