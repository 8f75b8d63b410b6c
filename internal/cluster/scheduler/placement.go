package scheduler

import (
	"fmt"
	"slices"
	"strconv"
	"strings"

	pb "github.com/aenv-dev/aenv/internal/cluster/scheduler/gen/schedulerv1"
)

// candidate is a node that can take the sandbox, with what ranks it.
type candidate struct {
	n        *node
	locality int     // template held (1) + requested layers held
	load     float64 // the most used of CPU, memory and sandbox slots, after this placement
	count    int64   // sandboxes after this placement: ranks nodes whose capacity is unlimited
}

// Place picks a node for a new sandbox and reserves the resources on it:
//  1. filter: fresh heartbeat, not draining, backend kind, not excluded, enough free
//     CPU, memory and sandbox slots (allocated + reserved + the request ≤ capacity);
//  2. locality: keep the nodes holding the most of the template and its layers;
//  3. best of K: of K nodes drawn at random, the least loaded (ties: fewest sandboxes,
//     which is all there is to go by on nodes of unlimited capacity; then lowest id).
//
// A request's prefer_node_id that passes the filter is taken before 2 and 3: a fork's
// children go on their source's node while it has room, and elsewhere only past that.
//
// Drawing K instead of taking the global minimum keeps concurrent gateways from all
// piling onto the same least-loaded node between heartbeats.
func (s *State) Place(req *pb.PlaceRequest) (*pb.PlaceResponse, error) {
	want := resOf(req.GetResources())
	if want.cpu < 0 || want.memMB < 0 {
		return nil, fmt.Errorf("%w: negative resources", ErrInvalid)
	}
	want.sandboxes = 1
	now := s.cfg.Now()

	s.mu.Lock()
	defer s.mu.Unlock()
	cands := s.cands[:0]
	defer func() { s.cands = cands[:0] }()
	best := 0
	var why rejections
	var preferred *node
	for id, n := range s.nodes {
		switch {
		case slices.Contains(req.ExcludeNodeIds, id):
			why.excluded++
			continue
		case now.Sub(n.lastSeen) > s.cfg.StaleAfter:
			why.stale++
			continue
		case n.draining:
			why.draining++
			continue
		case !s.servingLocked(id):
			why.unserving++
			continue
		case req.Backend != "" && n.info.Backend != req.Backend:
			why.backend++
			continue
		}
		used := n.allocated.add(n.held).add(want)
		load, fits := loadOf(used, n.capacity)
		if !fits {
			why.full++
			continue
		}
		if id == req.PreferNodeId {
			preferred = n
		}
		loc := 0
		if _, ok := n.templates[req.TemplateId]; ok && req.TemplateId != "" {
			loc++
		}
		for _, l := range req.Layers {
			if _, ok := n.layers[l]; ok {
				loc++
			}
		}
		if loc < best {
			continue
		}
		if loc > best {
			best = loc
			cands = cands[:0]
		}
		cands = append(cands, candidate{n: n, locality: loc, load: load, count: used.sandboxes})
	}
	if len(cands) == 0 && preferred == nil {
		return nil, fmt.Errorf("%w: %s", ErrNoCapacity, why.String(len(s.nodes)))
	}
	var pick candidate
	if preferred != nil {
		pick.n = preferred
	} else {
		pick = s.bestOfKLocked(cands)
	}

	s.nextID++
	rid := "r" + strconv.FormatUint(s.nextID, 36)
	h := &hold{node: pick.n.info.Id, amount: want, expires: now.Add(s.cfg.ReservationTTL)}
	s.reserved[rid] = h
	pick.n.held = pick.n.held.add(want)
	return &pb.PlaceResponse{Node: pick.n.info, ReservationId: rid}, nil
}

func (s *State) bestOfKLocked(cands []candidate) candidate {
	k := s.cfg.Choices
	if k < len(cands) {
		// Partial Fisher-Yates: the first k entries become a uniform sample.
		for i := 0; i < k; i++ {
			j := i + s.cfg.Rand.IntN(len(cands)-i)
			cands[i], cands[j] = cands[j], cands[i]
		}
		cands = cands[:k]
	}
	best := cands[0]
	for _, c := range cands[1:] {
		if c.less(best) {
			best = c
		}
	}
	return best
}

// less ranks by load, then sandbox count, then id (for a stable choice).
func (c candidate) less(o candidate) bool {
	if c.load != o.load {
		return c.load < o.load
	}
	if c.count != o.count {
		return c.count < o.count
	}
	return c.n.info.Id < o.n.info.Id
}

// loadOf returns the highest used/capacity ratio and whether used fits; a capacity of 0
// is unlimited and does not count towards the load.
func loadOf(used, capacity res) (float64, bool) {
	load := 0.0
	for _, d := range [][2]int64{{used.cpu, capacity.cpu}, {used.memMB, capacity.memMB}, {used.sandboxes, capacity.sandboxes}} {
		if d[1] <= 0 {
			continue
		}
		if d[0] > d[1] {
			return 0, false
		}
		load = max(load, float64(d[0])/float64(d[1]))
	}
	return load, true
}

// rejections counts why nodes were passed over, for an error that says what to fix.
type rejections struct {
	excluded, stale, draining, unserving, backend, full int
}

func (r rejections) String(total int) string {
	if total == 0 {
		return "no nodes have registered (are nodes started with --scheduler pointing here?)"
	}
	var parts []string
	for _, p := range []struct {
		n    int
		what string
	}{{r.full, "lack free CPU, memory or sandbox slots"}, {r.stale, "have stale heartbeats"}, {r.draining, "are draining"},
		{r.unserving, "are not serving in discovery (not ready, terminating or unlisted)"},
		{r.backend, "run another backend"}, {r.excluded, "were excluded"}} {
		if p.n > 0 {
			parts = append(parts, fmt.Sprintf("%d %s", p.n, p.what))
		}
	}
	return fmt.Sprintf("of %d nodes, %s", total, strings.Join(parts, ", "))
}
