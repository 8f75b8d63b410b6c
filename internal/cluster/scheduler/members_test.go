package scheduler

import (
	"errors"
	"strings"
	"testing"
	"time"

	pb "github.com/aenv-dev/aenv/internal/cluster/scheduler/gen/schedulerv1"
)

func TestMembers(t *testing.T) {
	s, _ := newTestState(t)
	beat(t, s, hb{id: "a", cpu: 8, mem: 8192}, hb{id: "b", cpu: 8, mem: 8192})

	// Discovery lists a (serving) and b (terminating); c is not listed.
	s.SetMembers([]Member{{ID: "a", Serving: true}, {ID: "b"}})
	if err := s.Heartbeat(hb{id: "c", cpu: 8, mem: 8192}.req()); !errors.Is(err, ErrUnknownNode) || !strings.Contains(err.Error(), "discovered") {
		t.Fatalf("heartbeat from an unlisted node = %v, want ErrUnknownNode naming discovery", err)
	}
	beat(t, s, hb{id: "b", cpu: 8, mem: 8192, sandboxes: []string{"sb1"}})
	for i := 0; i < 20; i++ {
		if id, err := place(s, &pb.PlaceRequest{}); err != nil || id != "a" {
			t.Fatalf("place = %s, %v; want a (b is not serving)", id, err)
		}
	}
	states := map[string]pb.NodeState{}
	for _, n := range s.Nodes() {
		states[n.Node.Id] = n.State
	}
	if states["a"] != pb.NodeState_NODE_STATE_READY || states["b"] != pb.NodeState_NODE_STATE_DRAINING {
		t.Fatalf("node states = %v, want a ready and b draining", states)
	}
	if l, err := s.Lookup("sb1"); err != nil || l.Node.Id != "b" {
		t.Fatalf("a non-serving node keeps its sandboxes: Lookup = %v, %v", l, err)
	}

	// a leaves discovery: no node serves, and the error says why.
	s.SetMembers([]Member{{ID: "b"}})
	if _, err := place(s, &pb.PlaceRequest{}); !errors.Is(err, ErrNoCapacity) || !strings.Contains(err.Error(), "2 are not serving in discovery") {
		t.Fatalf("place with no serving member = %v", err)
	}
	if err := s.Heartbeat(hb{id: "a", cpu: 8, mem: 8192}.req()); !errors.Is(err, ErrUnknownNode) {
		t.Fatalf("heartbeat from a node that left discovery = %v", err)
	}

	// Open again: anyone joins, everyone serves; a Reset keeps the members.
	s.SetMembers([]Member{{ID: "c", Serving: true}})
	s.Reset()
	if err := s.Heartbeat(hb{id: "a", cpu: 8, mem: 8192}.req()); !errors.Is(err, ErrUnknownNode) {
		t.Fatalf("members survive a Reset: heartbeat from a = %v", err)
	}
	s.SetMembers(nil)
	beat(t, s, hb{id: "a", cpu: 8, mem: 8192}, hb{id: "c", cpu: 8, mem: 8192})
	if _, err := place(s, &pb.PlaceRequest{}); err != nil {
		t.Fatal(err)
	}
}

func TestReset(t *testing.T) {
	s, c := newTestState(t)
	beat(t, s, hb{id: "a", cpu: 8, mem: 8192, sandboxes: []string{"sb1"}, layers: []string{"l1"}})
	if _, err := s.Place(&pb.PlaceRequest{Resources: &pb.Resources{CpuCount: 1}}); err != nil {
		t.Fatal(err)
	}
	s.Reset()
	if n := s.Nodes(); len(n) != 0 {
		t.Fatalf("nodes after Reset = %v", n)
	}
	// Warming up again: an unknown sandbox is "try again", not "not found".
	if _, err := s.Lookup("sb1"); !errors.Is(err, ErrWarmingUp) {
		t.Fatalf("Lookup right after Reset = %v, want ErrWarmingUp", err)
	}
	beat(t, s, hb{id: "a", cpu: 8, mem: 8192, sandboxes: []string{"sb1"}, layers: []string{"l1"}})
	if l, err := s.Lookup("sb1"); err != nil || l.Node.Id != "a" {
		t.Fatalf("Lookup after a heartbeat = %v, %v", l, err)
	}
	if p, _ := s.Peers("l1", ""); len(p) != 1 {
		t.Fatalf("peers after a heartbeat = %v", p)
	}
	for _, n := range s.Nodes() {
		if n.Reserved.GetCpuCount() != 0 {
			t.Fatalf("a reservation survived Reset: %v", n.Reserved)
		}
	}
	c.advance(6 * time.Second)
	if _, err := s.Lookup("nope"); !errors.Is(err, ErrNotFound) {
		t.Fatalf("Lookup after the warm-up = %v, want ErrNotFound", err)
	}
}
