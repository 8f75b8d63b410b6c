package scheduler

// Member is a node that a discovery source (a static list, or the EndpointSlices of the
// nodes' Kubernetes Service) says belongs to the cluster.
type Member struct {
	ID string
	// Serving is false for a node being stopped or not ready: it keeps its sandboxes and
	// its heartbeats count, but it gets no new placements.
	Serving bool
}

// SetMembers restricts the cluster to members; nil opens it again to any node that
// heartbeats. A heartbeat from a node not listed is refused, and a registered node that
// is no longer listed, or not serving, gets no placements: it goes stale and is
// forgotten unless discovery lists it again. Discovery sources call it on every change.
func (s *State) SetMembers(members []Member) {
	var m map[string]bool
	if members != nil {
		m = make(map[string]bool, len(members))
		for _, mb := range members {
			m[mb.ID] = m[mb.ID] || mb.Serving
		}
	}
	s.mu.Lock()
	s.members = m
	s.mu.Unlock()
}

// admitsLocked reports whether discovery lets the node heartbeat.
func (s *State) admitsLocked(id string) bool {
	if s.members == nil {
		return true
	}
	_, ok := s.members[id]
	return ok
}

// servingLocked reports whether discovery lets the node take new sandboxes.
func (s *State) servingLocked(id string) bool {
	return s.members == nil || s.members[id]
}
