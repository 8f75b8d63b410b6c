// Package scheduler is the cluster's placement service: nodes report their capacity,
// allocations, sandboxes and layers through heartbeats; gateways ask it where a new
// sandbox should go and where an existing one lives; nodes ask it which peers hold a
// layer. Its state is memory only and rebuilt from heartbeats: nodes are the source of
// truth, so a restarted scheduler knows the cluster again after one heartbeat interval.
package scheduler

import (
	"errors"
	"fmt"
	"math/rand/v2"
	"sort"
	"sync"
	"time"

	pb "github.com/aenv-dev/aenv/internal/cluster/scheduler/gen/schedulerv1"
)

// Errors State returns; the gRPC layer maps them to status codes.
var (
	ErrInvalid     = errors.New("invalid request")
	ErrNotFound    = errors.New("not found")
	ErrNoCapacity  = errors.New("no node can take the sandbox")
	ErrUnknownNode = errors.New("unknown node")
	// ErrWarmingUp is a lookup miss shortly after the scheduler started, when nodes may
	// not have reported their sandboxes yet: "try again", not "no such sandbox".
	ErrWarmingUp = errors.New("the scheduler started moments ago and is still learning the cluster from heartbeats")
)

// Config tunes the scheduler. Zero values take the defaults.
type Config struct {
	// HeartbeatInterval is what nodes are asked to keep (default 2s).
	HeartbeatInterval time.Duration
	// StaleAfter is the heartbeat age beyond which a node gets no placements and its
	// sandboxes are reported unreachable (default 5 intervals).
	StaleAfter time.Duration
	// ForgetAfter is the heartbeat age beyond which a node and its bindings are dropped
	// (default 10 minutes): lookups then answer "unknown sandbox".
	ForgetAfter time.Duration
	// ReservationTTL bounds how long a placement holds resources without a Bind or a
	// heartbeat that shows the sandbox (default 30s).
	ReservationTTL time.Duration
	// Choices is K in "best of K least loaded" (default 2).
	Choices int
	// Now and Rand are for tests; the defaults are time.Now and a random seed.
	Now  func() time.Time
	Rand *rand.Rand
}

func (c *Config) fill() {
	if c.HeartbeatInterval <= 0 {
		c.HeartbeatInterval = 2 * time.Second
	}
	if c.StaleAfter <= 0 {
		c.StaleAfter = 5 * c.HeartbeatInterval
	}
	if c.ForgetAfter <= 0 {
		c.ForgetAfter = 10 * time.Minute
	}
	if c.ReservationTTL <= 0 {
		c.ReservationTTL = 30 * time.Second
	}
	if c.Choices <= 0 {
		c.Choices = 2
	}
	if c.Now == nil {
		c.Now = time.Now
	}
	if c.Rand == nil {
		c.Rand = rand.New(rand.NewPCG(rand.Uint64(), rand.Uint64()))
	}
}

// res is a resource amount; capacity fields of 0 mean "no limit".
type res struct {
	cpu, memMB, sandboxes int64
}

func resOf(r *pb.Resources) res {
	if r == nil {
		return res{}
	}
	return res{cpu: int64(r.CpuCount), memMB: r.MemoryMb, sandboxes: int64(r.Sandboxes)}
}

func (r res) add(o res) res { return res{r.cpu + o.cpu, r.memMB + o.memMB, r.sandboxes + o.sandboxes} }
func (r res) sub(o res) res { return res{r.cpu - o.cpu, r.memMB - o.memMB, r.sandboxes - o.sandboxes} }

func (r res) pb() *pb.Resources {
	return &pb.Resources{CpuCount: int32(r.cpu), MemoryMb: r.memMB, Sandboxes: int32(r.sandboxes)}
}

// hold is resources promised to a sandbox the node's heartbeat does not show yet: a
// reservation (Place) or a binding awaiting its first heartbeat (Bind).
type hold struct {
	node    string
	amount  res
	expires time.Time
}

type node struct {
	info      *pb.NodeInfo
	capacity  res
	allocated res // from the last heartbeat
	held      res // sum of this node's reservations and pending binds
	roster    map[string]*pb.SandboxReport
	templates map[string]struct{}
	layers    map[string]struct{}
	draining  bool
	lastSeen  time.Time
	stale     bool // a NODE_STALE event was sent for the current silence
}

// State is the scheduler's view of the cluster. Safe for concurrent use.
type State struct {
	cfg    Config
	events *broadcaster

	mu       sync.Mutex
	nodes    map[string]*node
	bindings map[string]string          // sandbox id → node id
	holders  map[string]map[string]bool // layer digest → node ids
	reserved map[string]*hold           // reservation id → hold
	pending  map[string]*hold           // sandbox id → hold, bound but not yet in a heartbeat
	members  map[string]bool            // discovered node id → serving; nil: any node may join
	nextID   uint64
	cands    []candidate // Place's scratch space, reused under mu
	// warmUntil ends the warm-up after start: by then every live node has reported.
	warmUntil time.Time
}

// New returns an empty State.
func New(cfg Config) *State {
	cfg.fill()
	return &State{
		cfg:       cfg,
		warmUntil: cfg.Now().Add(cfg.StaleAfter),
		events:    newBroadcaster(),
		nodes:     map[string]*node{},
		bindings:  map[string]string{},
		holders:   map[string]map[string]bool{},
		reserved:  map[string]*hold{},
		pending:   map[string]*hold{},
	}
}

// Reset forgets every node, binding and reservation and starts a new warm-up, as a
// restarted scheduler would: a replica that starts leading knows nothing it can trust.
func (s *State) Reset() {
	now := s.cfg.Now()
	s.mu.Lock()
	s.warmUntil = now.Add(s.cfg.StaleAfter)
	s.nodes = map[string]*node{}
	s.bindings = map[string]string{}
	s.holders = map[string]map[string]bool{}
	s.reserved = map[string]*hold{}
	s.pending = map[string]*hold{}
	s.mu.Unlock()
}

// Interval is the heartbeat interval nodes are asked to keep.
func (s *State) Interval() time.Duration { return s.cfg.HeartbeatInterval }

// Heartbeat registers or refreshes a node. The roster replaces the previous one: a
// sandbox missing from it is gone from the node.
func (s *State) Heartbeat(req *pb.HeartbeatRequest) error {
	info := req.GetNode()
	if info.GetId() == "" || info.GetEndpoint() == "" {
		return fmt.Errorf("%w: a heartbeat needs node.id and node.endpoint", ErrInvalid)
	}
	now := s.cfg.Now()
	var evs []*pb.Event
	s.mu.Lock()
	if !s.admitsLocked(info.Id) {
		s.mu.Unlock()
		return fmt.Errorf("%w %q: it is not among the discovered nodes (the scheduler's static --nodes list or the EndpointSlices of --nodes-service)", ErrUnknownNode, info.Id)
	}
	n, ok := s.nodes[info.Id]
	if !ok || n.stale || n.info.InstanceId != info.InstanceId {
		evs = append(evs, &pb.Event{Type: pb.Event_TYPE_NODE_UP, NodeId: info.Id})
	}
	if !ok {
		n = &node{roster: map[string]*pb.SandboxReport{}}
		s.nodes[info.Id] = n
	}
	n.info = info
	n.capacity = resOf(info.Capacity)
	n.allocated = resOf(req.Allocated)
	n.draining = req.Draining
	n.lastSeen = now
	n.stale = false

	roster := make(map[string]*pb.SandboxReport, len(req.Sandboxes))
	for _, sb := range req.Sandboxes {
		if sb.GetId() == "" {
			continue
		}
		roster[sb.Id] = sb
		if cur := s.bindings[sb.Id]; cur != info.Id && !s.movedLocked(sb, cur, now) {
			s.bindings[sb.Id] = info.Id
		}
		if h := s.pending[sb.Id]; h != nil {
			// The heartbeat's allocation now counts it.
			s.dropHoldLocked(h)
			delete(s.pending, sb.Id)
		}
	}
	for id := range n.roster {
		if _, still := roster[id]; !still && s.bindings[id] == info.Id && s.pending[id] == nil {
			delete(s.bindings, id)
			evs = append(evs, &pb.Event{Type: pb.Event_TYPE_SANDBOX_GONE, NodeId: info.Id, SandboxId: id})
		}
	}
	n.roster = roster

	n.templates = make(map[string]struct{}, len(req.Templates))
	for _, t := range req.Templates {
		n.templates[t] = struct{}{}
	}
	layers := make(map[string]struct{}, len(req.Layers))
	for _, l := range req.Layers {
		layers[l] = struct{}{}
		if _, had := n.layers[l]; !had {
			h := s.holders[l]
			if h == nil {
				h = map[string]bool{}
				s.holders[l] = h
			}
			h[info.Id] = true
		}
	}
	for l := range n.layers {
		if _, still := layers[l]; !still {
			s.dropHolderLocked(l, info.Id)
		}
	}
	n.layers = layers
	s.mu.Unlock()
	s.events.publish(now, evs...)
	return nil
}

// movedLocked reports whether a sandbox a node reports paused now lives on node cur, a
// fresh node that resumed it from that node's published pause: the old node lists it
// until it notices (orchestrator.ReconcileHandoffs) and must not take the binding back.
func (s *State) movedLocked(sb *pb.SandboxReport, cur string, now time.Time) bool {
	if sb.GetState() != "paused" || cur == "" {
		return false
	}
	n := s.nodes[cur]
	return n != nil && now.Sub(n.lastSeen) <= s.cfg.StaleAfter
}

// Unregister removes a node and its bindings. An instance id that is not the node's
// current one is ignored: a restarted node already replaced it.
func (s *State) Unregister(nodeID, instanceID string) error {
	if nodeID == "" {
		return fmt.Errorf("%w: node_id is required", ErrInvalid)
	}
	s.mu.Lock()
	n, ok := s.nodes[nodeID]
	if !ok || (instanceID != "" && n.info.InstanceId != instanceID) {
		s.mu.Unlock()
		return nil
	}
	evs := s.removeNodeLocked(nodeID, n)
	s.mu.Unlock()
	s.events.publish(s.cfg.Now(), evs...)
	return nil
}

func (s *State) removeNodeLocked(id string, n *node) []*pb.Event {
	var evs []*pb.Event
	for sb, nid := range s.bindings {
		if nid == id {
			delete(s.bindings, sb)
			evs = append(evs, &pb.Event{Type: pb.Event_TYPE_SANDBOX_GONE, NodeId: id, SandboxId: sb})
		}
	}
	for rid, h := range s.reserved {
		if h.node == id {
			delete(s.reserved, rid)
		}
	}
	for sb, h := range s.pending {
		if h.node == id {
			delete(s.pending, sb)
		}
	}
	for l := range n.layers {
		s.dropHolderLocked(l, id)
	}
	delete(s.nodes, id)
	return append(evs, &pb.Event{Type: pb.Event_TYPE_NODE_DOWN, NodeId: id})
}

func (s *State) dropHolderLocked(layer, nodeID string) {
	if h := s.holders[layer]; h != nil {
		delete(h, nodeID)
		if len(h) == 0 {
			delete(s.holders, layer)
		}
	}
}

func (s *State) dropHoldLocked(h *hold) {
	if n := s.nodes[h.node]; n != nil {
		n.held = n.held.sub(h.amount)
	}
}

// Bind records that sandboxID lives on nodeID, turning the placement's reservation (if
// any) into a hold that lasts until a heartbeat lists the sandbox.
func (s *State) Bind(sandboxID, nodeID, reservationID string) error {
	if sandboxID == "" || nodeID == "" {
		return fmt.Errorf("%w: sandbox_id and node_id are required", ErrInvalid)
	}
	now := s.cfg.Now()
	s.mu.Lock()
	n, ok := s.nodes[nodeID]
	if !ok {
		s.mu.Unlock()
		return fmt.Errorf("%w %q", ErrUnknownNode, nodeID)
	}
	h := s.reserved[reservationID]
	if reservationID != "" && (h == nil || h.node != nodeID) {
		h = nil
	}
	if h != nil {
		delete(s.reserved, reservationID)
		if _, listed := n.roster[sandboxID]; listed {
			s.dropHoldLocked(h)
		} else {
			h.expires = now.Add(s.cfg.ReservationTTL)
			if old := s.pending[sandboxID]; old != nil {
				s.dropHoldLocked(old)
			}
			s.pending[sandboxID] = h
		}
	}
	s.bindings[sandboxID] = nodeID
	s.mu.Unlock()
	s.events.publish(now, &pb.Event{Type: pb.Event_TYPE_SANDBOX_BOUND, NodeId: nodeID, SandboxId: sandboxID})
	return nil
}

// Release returns a reservation's resources; an unknown id is a no-op (it expired).
func (s *State) Release(reservationID string) {
	s.mu.Lock()
	if h := s.reserved[reservationID]; h != nil {
		s.dropHoldLocked(h)
		delete(s.reserved, reservationID)
	}
	s.mu.Unlock()
}

// Lookup returns the node holding a sandbox, its state and its heartbeat age.
func (s *State) Lookup(sandboxID string) (*pb.LookupResponse, error) {
	if sandboxID == "" {
		return nil, fmt.Errorf("%w: sandbox_id is required", ErrInvalid)
	}
	now := s.cfg.Now()
	s.mu.Lock()
	defer s.mu.Unlock()
	nid, ok := s.bindings[sandboxID]
	if !ok {
		if now.Before(s.warmUntil) {
			return nil, fmt.Errorf("%w: sandbox %q is not known yet", ErrWarmingUp, sandboxID)
		}
		return nil, fmt.Errorf("%w: sandbox %q is on no known node", ErrNotFound, sandboxID)
	}
	n := s.nodes[nid]
	return &pb.LookupResponse{Node: n.info, State: s.stateLocked(n, now), HeartbeatAgeMs: now.Sub(n.lastSeen).Milliseconds(),
		Sandbox: n.roster[sandboxID]}, nil
}

func (s *State) stateLocked(n *node, now time.Time) pb.NodeState {
	switch {
	case now.Sub(n.lastSeen) > s.cfg.StaleAfter:
		return pb.NodeState_NODE_STATE_STALE
	case n.draining || !s.servingLocked(n.info.Id):
		return pb.NodeState_NODE_STATE_DRAINING
	}
	return pb.NodeState_NODE_STATE_READY
}

// Nodes lists every known node, ordered by id.
func (s *State) Nodes() []*pb.NodeStatus {
	now := s.cfg.Now()
	s.mu.Lock()
	out := make([]*pb.NodeStatus, 0, len(s.nodes))
	for _, n := range s.nodes {
		out = append(out, &pb.NodeStatus{
			Node:                n.info,
			State:               s.stateLocked(n, now),
			Allocated:           n.allocated.pb(),
			Reserved:            n.held.pb(),
			Sandboxes:           int32(len(n.roster)),
			Layers:              int32(len(n.layers)),
			LastHeartbeatUnixMs: n.lastSeen.UnixMilli(),
		})
	}
	s.mu.Unlock()
	sort.Slice(out, func(i, j int) bool { return out[i].Node.Id < out[j].Node.Id })
	return out
}

// Peers lists the nodes with fresh heartbeats that hold layer, except exclude.
func (s *State) Peers(layer, exclude string) ([]*pb.NodeInfo, error) {
	if layer == "" {
		return nil, fmt.Errorf("%w: layer is required", ErrInvalid)
	}
	now := s.cfg.Now()
	s.mu.Lock()
	var out []*pb.NodeInfo
	for id := range s.holders[layer] {
		n := s.nodes[id]
		if id == exclude || n == nil || n.info.P2PEndpoint == "" || now.Sub(n.lastSeen) > s.cfg.StaleAfter {
			continue
		}
		out = append(out, n.info)
	}
	s.mu.Unlock()
	sort.Slice(out, func(i, j int) bool { return out[i].Id < out[j].Id })
	return out, nil
}

// Sweep expires reservations and pending binds, reports nodes that went stale and forgets
// nodes silent for longer than ForgetAfter. Run calls it periodically.
func (s *State) Sweep() {
	now := s.cfg.Now()
	var evs []*pb.Event
	s.mu.Lock()
	for id, h := range s.reserved {
		if now.After(h.expires) {
			s.dropHoldLocked(h)
			delete(s.reserved, id)
		}
	}
	for sb, h := range s.pending {
		if now.After(h.expires) {
			s.dropHoldLocked(h)
			delete(s.pending, sb)
			// Bound but never reported: the sandbox died before its node's next heartbeat.
			if n := s.nodes[h.node]; n != nil && n.roster[sb] == nil && s.bindings[sb] == h.node {
				delete(s.bindings, sb)
				evs = append(evs, &pb.Event{Type: pb.Event_TYPE_SANDBOX_GONE, NodeId: h.node, SandboxId: sb})
			}
		}
	}
	for id, n := range s.nodes {
		age := now.Sub(n.lastSeen)
		switch {
		case age > s.cfg.ForgetAfter:
			evs = append(evs, s.removeNodeLocked(id, n)...)
		case age > s.cfg.StaleAfter && !n.stale:
			n.stale = true
			evs = append(evs, &pb.Event{Type: pb.Event_TYPE_NODE_STALE, NodeId: id})
		}
	}
	s.mu.Unlock()
	s.events.publish(now, evs...)
}
