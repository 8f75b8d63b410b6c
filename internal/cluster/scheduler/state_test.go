package scheduler

import (
	"errors"
	"math/rand/v2"
	"testing"
	"time"

	pb "github.com/aenv-dev/aenv/internal/cluster/scheduler/gen/schedulerv1"
)

// clock is a settable time source.
type clock struct{ t time.Time }

func (c *clock) now() time.Time          { return c.t }
func (c *clock) advance(d time.Duration) { c.t = c.t.Add(d) }

func newTestState(t *testing.T) (*State, *clock) {
	t.Helper()
	c := &clock{t: time.Unix(1_800_000_000, 0)}
	s := New(Config{HeartbeatInterval: time.Second, StaleAfter: 5 * time.Second, ForgetAfter: time.Minute,
		ReservationTTL: 10 * time.Second, Now: c.now, Rand: rand.New(rand.NewPCG(1, 2))})
	c.advance(6 * time.Second) // past the warm-up (TestWarmUp covers it)
	return s, c
}

type hb struct {
	id        string
	cpu, mem  int64 // capacity
	allocCPU  int64
	allocMem  int64
	sandboxes []string
	templates []string
	layers    []string
	backend   string
	draining  bool
	instance  string
}

func (h hb) req() *pb.HeartbeatRequest {
	backend := h.backend
	if backend == "" {
		backend = "oci"
	}
	r := &pb.HeartbeatRequest{
		Node: &pb.NodeInfo{Id: h.id, Endpoint: "http://" + h.id + ":8000", P2PEndpoint: "http://" + h.id + ":8001",
			Backend: backend, InstanceId: h.instance,
			Capacity: &pb.Resources{CpuCount: int32(h.cpu), MemoryMb: h.mem, Sandboxes: 100}},
		Allocated: &pb.Resources{CpuCount: int32(h.allocCPU), MemoryMb: h.allocMem, Sandboxes: int32(len(h.sandboxes))},
		Templates: h.templates, Layers: h.layers, Draining: h.draining,
	}
	for _, id := range h.sandboxes {
		r.Sandboxes = append(r.Sandboxes, &pb.SandboxReport{Id: id, State: "running"})
	}
	return r
}

func beat(t *testing.T, s *State, hs ...hb) {
	t.Helper()
	for _, h := range hs {
		if err := s.Heartbeat(h.req()); err != nil {
			t.Fatalf("heartbeat %s: %v", h.id, err)
		}
	}
}

func place(s *State, req *pb.PlaceRequest) (string, error) {
	resp, err := s.Place(req)
	if err != nil {
		return "", err
	}
	return resp.Node.Id, nil
}

func TestPlaceFilters(t *testing.T) {
	small := &pb.Resources{CpuCount: 1, MemoryMb: 512}
	for _, tc := range []struct {
		name  string
		nodes []hb
		req   *pb.PlaceRequest
		want  []string // any of these; empty: ErrNoCapacity
	}{
		{"only fitting node", []hb{{id: "a", cpu: 4, mem: 4096, allocCPU: 4}, {id: "b", cpu: 4, mem: 4096}},
			&pb.PlaceRequest{Resources: small}, []string{"b"}},
		{"memory full", []hb{{id: "a", cpu: 4, mem: 4096, allocMem: 3800}}, &pb.PlaceRequest{Resources: small}, nil},
		{"backend kind", []hb{{id: "a", cpu: 4, mem: 4096}, {id: "b", cpu: 4, mem: 4096, backend: "microvm"}},
			&pb.PlaceRequest{Resources: small, Backend: "microvm"}, []string{"b"}},
		{"draining skipped", []hb{{id: "a", cpu: 4, mem: 4096, draining: true}, {id: "b", cpu: 4, mem: 4096}},
			&pb.PlaceRequest{Resources: small}, []string{"b"}},
		{"excluded", []hb{{id: "a", cpu: 4, mem: 4096}, {id: "b", cpu: 4, mem: 4096}},
			&pb.PlaceRequest{Resources: small, ExcludeNodeIds: []string{"a"}}, []string{"b"}},
		{"template holder preferred", []hb{{id: "a", cpu: 4, mem: 4096}, {id: "b", cpu: 4, mem: 4096, allocCPU: 2, templates: []string{"py"}}},
			&pb.PlaceRequest{Resources: small, TemplateId: "py"}, []string{"b"}},
		{"most layers preferred", []hb{{id: "a", cpu: 4, mem: 4096, layers: []string{"l1"}}, {id: "b", cpu: 4, mem: 4096, layers: []string{"l1", "l2"}}},
			&pb.PlaceRequest{Resources: small, Layers: []string{"l1", "l2"}}, []string{"b"}},
		{"locality gives way to capacity", []hb{{id: "a", cpu: 4, mem: 4096, allocCPU: 4, templates: []string{"py"}}, {id: "b", cpu: 4, mem: 4096}},
			&pb.PlaceRequest{Resources: small, TemplateId: "py"}, []string{"b"}},
		{"preferred node over a less loaded one", []hb{{id: "a", cpu: 4, mem: 4096, allocCPU: 3, templates: []string{"py"}}, {id: "b", cpu: 4, mem: 4096}},
			&pb.PlaceRequest{Resources: small, PreferNodeId: "a"}, []string{"a"}},
		{"preferred node full", []hb{{id: "a", cpu: 4, mem: 4096, allocCPU: 4}, {id: "b", cpu: 4, mem: 4096}},
			&pb.PlaceRequest{Resources: small, PreferNodeId: "a"}, []string{"b"}},
		{"preferred node excluded", []hb{{id: "a", cpu: 4, mem: 4096}, {id: "b", cpu: 4, mem: 4096, allocCPU: 3}},
			&pb.PlaceRequest{Resources: small, PreferNodeId: "a", ExcludeNodeIds: []string{"a"}}, []string{"b"}},
		{"preferred node draining", []hb{{id: "a", cpu: 4, mem: 4096, draining: true}}, &pb.PlaceRequest{Resources: small, PreferNodeId: "a"}, nil},
		{"unlimited capacity", []hb{{id: "a"}}, &pb.PlaceRequest{Resources: &pb.Resources{CpuCount: 64, MemoryMb: 1 << 20}}, []string{"a"}},
		{"no nodes", nil, &pb.PlaceRequest{Resources: small}, nil},
	} {
		t.Run(tc.name, func(t *testing.T) {
			s, _ := newTestState(t)
			beat(t, s, tc.nodes...)
			got, err := place(s, tc.req)
			if len(tc.want) == 0 {
				if !errors.Is(err, ErrNoCapacity) {
					t.Fatalf("Place = %q, %v; want ErrNoCapacity", got, err)
				}
				return
			}
			if err != nil || got != tc.want[0] {
				t.Fatalf("Place = %q, %v; want %v", got, err, tc.want)
			}
		})
	}
}

func TestPlaceNeverStale(t *testing.T) {
	s, c := newTestState(t)
	beat(t, s, hb{id: "a", cpu: 64, mem: 1 << 20})
	c.advance(3 * time.Second)
	beat(t, s, hb{id: "b", cpu: 2, mem: 2048})
	c.advance(3 * time.Second) // a: 6s old (stale), b: 3s
	for range 2 {
		if got, err := place(s, &pb.PlaceRequest{Resources: &pb.Resources{CpuCount: 1}}); err != nil || got != "b" {
			t.Fatalf("Place = %q, %v; want b", got, err)
		}
	}
	// b is now full through its reservations; a is stale, so nothing fits.
	_, err := place(s, &pb.PlaceRequest{Resources: &pb.Resources{CpuCount: 1}})
	if !errors.Is(err, ErrNoCapacity) {
		t.Fatalf("Place on full + stale nodes: %v; want ErrNoCapacity", err)
	}
	t.Log(err)
}

func TestReservationsSpreadAndExpire(t *testing.T) {
	s, c := newTestState(t)
	beat(t, s, hb{id: "a", cpu: 4, mem: 8192}, hb{id: "b", cpu: 4, mem: 8192})
	counts := map[string]int{}
	for range 8 {
		got, err := place(s, &pb.PlaceRequest{Resources: &pb.Resources{CpuCount: 1, MemoryMb: 256}})
		if err != nil {
			t.Fatal(err)
		}
		counts[got]++
	}
	if counts["a"] != 4 || counts["b"] != 4 {
		t.Fatalf("8 one-CPU placements on two 4-CPU nodes: %v, want 4 each", counts)
	}
	if _, err := place(s, &pb.PlaceRequest{Resources: &pb.Resources{CpuCount: 1}}); !errors.Is(err, ErrNoCapacity) {
		t.Fatalf("ninth placement: %v, want ErrNoCapacity", err)
	}
	c.advance(11 * time.Second)
	beat(t, s, hb{id: "a", cpu: 4, mem: 8192}, hb{id: "b", cpu: 4, mem: 8192})
	s.Sweep()
	if _, err := place(s, &pb.PlaceRequest{Resources: &pb.Resources{CpuCount: 1}}); err != nil {
		t.Fatalf("placement after the reservations expired: %v", err)
	}
}

// Nodes that set no capacity are ranked by their sandbox count.
func TestPlaceSpreadsOnUnlimitedNodes(t *testing.T) {
	s, _ := newTestState(t)
	beat(t, s, hb{id: "a", sandboxes: []string{"x", "y"}}, hb{id: "b"})
	r := hb{id: "a", sandboxes: []string{"x", "y"}}.req()
	r.Node.Capacity = nil
	r2 := hb{id: "b"}.req()
	r2.Node.Capacity = nil
	for _, req := range []*pb.HeartbeatRequest{r, r2} {
		if err := s.Heartbeat(req); err != nil {
			t.Fatal(err)
		}
	}
	counts := map[string]int{}
	for range 6 {
		got, err := place(s, &pb.PlaceRequest{Resources: &pb.Resources{CpuCount: 2}})
		if err != nil {
			t.Fatal(err)
		}
		counts[got]++
	}
	// b catches up with a's two sandboxes first, then they alternate.
	if counts["a"] != 2 || counts["b"] != 4 {
		t.Fatalf("6 placements on unlimited nodes a (2 sandboxes) and b (none): %v, want a 2, b 4", counts)
	}
}

func TestBindHoldsUntilHeartbeat(t *testing.T) {
	s, _ := newTestState(t)
	beat(t, s, hb{id: "a", cpu: 2, mem: 8192})
	resp, err := s.Place(&pb.PlaceRequest{Resources: &pb.Resources{CpuCount: 2}})
	if err != nil {
		t.Fatal(err)
	}
	if err := s.Bind("sb1", "a", resp.ReservationId); err != nil {
		t.Fatal(err)
	}
	// The node's heartbeat does not list sb1 yet: the bind still holds the CPUs.
	beat(t, s, hb{id: "a", cpu: 2, mem: 8192})
	if _, err := place(s, &pb.PlaceRequest{Resources: &pb.Resources{CpuCount: 1}}); !errors.Is(err, ErrNoCapacity) {
		t.Fatalf("placement while the bind holds the node: %v, want ErrNoCapacity", err)
	}
	if l, err := s.Lookup("sb1"); err != nil || l.Node.Id != "a" {
		t.Fatalf("Lookup(sb1) = %v, %v", l, err)
	}
	// Now the heartbeat counts it; then the sandbox goes away.
	beat(t, s, hb{id: "a", cpu: 2, mem: 8192, allocCPU: 2, sandboxes: []string{"sb1"}})
	if _, err := place(s, &pb.PlaceRequest{Resources: &pb.Resources{CpuCount: 1}}); !errors.Is(err, ErrNoCapacity) {
		t.Fatalf("placement on a full node: %v, want ErrNoCapacity", err)
	}
	beat(t, s, hb{id: "a", cpu: 2, mem: 8192})
	if _, err := place(s, &pb.PlaceRequest{Resources: &pb.Resources{CpuCount: 1}}); err != nil {
		t.Fatalf("placement after the sandbox ended: %v", err)
	}
	if _, err := s.Lookup("sb1"); !errors.Is(err, ErrNotFound) {
		t.Fatalf("Lookup of an ended sandbox: %v, want ErrNotFound", err)
	}
}

func TestBindUnknownNode(t *testing.T) {
	s, _ := newTestState(t)
	if err := s.Bind("sb", "ghost", ""); !errors.Is(err, ErrUnknownNode) {
		t.Fatalf("Bind on an unknown node: %v", err)
	}
	if _, err := s.Lookup("sb"); !errors.Is(err, ErrNotFound) {
		t.Fatalf("a failed Bind left a binding: %v", err)
	}
}

func TestLookupStaleAndForgotten(t *testing.T) {
	s, c := newTestState(t)
	w := s.events.subscribe()
	beat(t, s, hb{id: "a", sandboxes: []string{"sb1", "sb2"}})
	c.advance(6 * time.Second)
	s.Sweep()
	l, err := s.Lookup("sb1")
	if err != nil || l.State != pb.NodeState_NODE_STATE_STALE || l.HeartbeatAgeMs != 6000 {
		t.Fatalf("Lookup on a silent node = %v, %v; want STALE, 6000 ms", l, err)
	}
	c.advance(time.Minute)
	s.Sweep()
	if _, err := s.Lookup("sb1"); !errors.Is(err, ErrNotFound) {
		t.Fatalf("Lookup on a forgotten node: %v", err)
	}
	var types []pb.Event_Type
	for len(w.C) > 0 {
		types = append(types, (<-w.C).Type)
	}
	want := []pb.Event_Type{pb.Event_TYPE_NODE_UP, pb.Event_TYPE_NODE_STALE, pb.Event_TYPE_SANDBOX_GONE,
		pb.Event_TYPE_SANDBOX_GONE, pb.Event_TYPE_NODE_DOWN}
	if len(types) != len(want) {
		t.Fatalf("events %v, want %v", types, want)
	}
	for i := range want {
		if types[i] != want[i] {
			t.Fatalf("events %v, want %v", types, want)
		}
	}
}

// A restarted scheduler knows every sandbox again after one heartbeat from each node.
func TestRebuildFromHeartbeats(t *testing.T) {
	nodes := []hb{{id: "a", sandboxes: []string{"x", "y"}, layers: []string{"L"}}, {id: "b", sandboxes: []string{"z"}}}
	s, _ := newTestState(t)
	if _, err := s.Lookup("x"); !errors.Is(err, ErrNotFound) {
		t.Fatal("a fresh scheduler knows a sandbox")
	}
	beat(t, s, nodes...)
	for sb, node := range map[string]string{"x": "a", "y": "a", "z": "b"} {
		if l, err := s.Lookup(sb); err != nil || l.Node.Id != node {
			t.Fatalf("Lookup(%s) = %v, %v; want %s", sb, l, err, node)
		}
	}
	if p, err := s.Peers("L", ""); err != nil || len(p) != 1 || p[0].Id != "a" {
		t.Fatalf("Peers(L) = %v, %v", p, err)
	}
}

// Right after a (re)start, a miss may be a sandbox whose node has not reported yet.
func TestWarmUp(t *testing.T) {
	c := &clock{t: time.Unix(1_800_000_000, 0)}
	s := New(Config{HeartbeatInterval: time.Second, StaleAfter: 5 * time.Second, Now: c.now})
	if _, err := s.Lookup("x"); !errors.Is(err, ErrWarmingUp) {
		t.Fatalf("lookup miss at start: %v, want ErrWarmingUp", err)
	}
	beat(t, s, hb{id: "a", sandboxes: []string{"x"}})
	if l, err := s.Lookup("x"); err != nil || l.Node.Id != "a" {
		t.Fatalf("Lookup(x) after a's heartbeat = %v, %v", l, err)
	}
	c.advance(5 * time.Second)
	if _, err := s.Lookup("y"); !errors.Is(err, ErrNotFound) {
		t.Fatalf("lookup miss after the warm-up: %v, want ErrNotFound", err)
	}
}

func TestPeers(t *testing.T) {
	s, c := newTestState(t)
	beat(t, s, hb{id: "a", layers: []string{"L1", "L2"}}, hb{id: "b", layers: []string{"L1"}})
	c.advance(3 * time.Second)
	beat(t, s, hb{id: "c", layers: []string{"L1"}})
	got := func(layer, exclude string) []string {
		p, err := s.Peers(layer, exclude)
		if err != nil {
			t.Fatal(err)
		}
		var ids []string
		for _, n := range p {
			ids = append(ids, n.Id)
		}
		return ids
	}
	if ids := got("L1", "b"); len(ids) != 3-1 || ids[0] != "a" || ids[1] != "c" {
		t.Fatalf("Peers(L1, exclude b) = %v", ids)
	}
	// a drops L2; then b goes stale.
	beat(t, s, hb{id: "a", layers: []string{"L1"}})
	if ids := got("L2", ""); len(ids) != 0 {
		t.Fatalf("Peers(L2) after a dropped it = %v", ids)
	}
	c.advance(2500 * time.Millisecond) // b: 5.5 s old
	if ids := got("L1", ""); len(ids) != 2 {
		t.Fatalf("Peers(L1) with b stale = %v, want a and c", ids)
	}
	if _, err := s.Peers("", ""); !errors.Is(err, ErrInvalid) {
		t.Fatalf("Peers without a layer: %v", err)
	}
}

func TestRestartedNodeAndUnregister(t *testing.T) {
	s, _ := newTestState(t)
	w := s.events.subscribe()
	beat(t, s, hb{id: "a", instance: "1", sandboxes: []string{"x"}})
	beat(t, s, hb{id: "a", instance: "1", sandboxes: []string{"x"}})
	beat(t, s, hb{id: "a", instance: "2"})
	if n := len(w.C); n != 3 { // up, up (restart), gone x
		t.Fatalf("%d events, want 3 (up, up after restart, x gone)", n)
	}
	// An unregister from the previous instance is ignored.
	if err := s.Unregister("a", "1"); err != nil {
		t.Fatal(err)
	}
	if len(s.Nodes()) != 1 {
		t.Fatal("an old instance's unregister removed the node")
	}
	if err := s.Unregister("a", "2"); err != nil || len(s.Nodes()) != 0 {
		t.Fatalf("Unregister: %v, %d nodes left", err, len(s.Nodes()))
	}
}

func TestHeartbeatRejectsBadInput(t *testing.T) {
	s, _ := newTestState(t)
	for _, req := range []*pb.HeartbeatRequest{{}, {Node: &pb.NodeInfo{Id: "a"}}, {Node: &pb.NodeInfo{Endpoint: "http://x"}}} {
		if err := s.Heartbeat(req); !errors.Is(err, ErrInvalid) {
			t.Fatalf("Heartbeat(%v): %v, want ErrInvalid", req, err)
		}
	}
	if len(s.Nodes()) != 0 {
		t.Fatal("a rejected heartbeat registered a node")
	}
	if _, err := s.Place(&pb.PlaceRequest{Resources: &pb.Resources{CpuCount: -1}}); !errors.Is(err, ErrInvalid) {
		t.Fatalf("negative CPU: %v", err)
	}
}
