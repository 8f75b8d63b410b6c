package scheduler

import (
	"errors"
	"fmt"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	pb "github.com/aenv-dev/aenv/internal/cluster/scheduler/gen/schedulerv1"
)

// Placement results, the label of aenv_scheduler_placements_total.
const (
	resultPlaced     = "placed"
	resultNoCapacity = "no_capacity"
	resultInvalid    = "invalid"
	resultError      = "error"
)

// metrics are the scheduler's Prometheus metrics. A nil *metrics records nothing (a
// Server without EnableMetrics).
type metrics struct {
	placements *prometheus.CounterVec
	placeDur   prometheus.Histogram
	heartbeats *prometheus.CounterVec
}

// EnableMetrics registers the scheduler's metrics on reg: placements by result and their
// latency, heartbeats by result, nodes by state (stale ones included), sandboxes bound,
// reservations held and whether this replica leads. Call it before serving.
func (srv *Server) EnableMetrics(reg prometheus.Registerer) error {
	if srv.metrics != nil {
		return errors.New("the scheduler's metrics are already enabled")
	}
	m := &metrics{
		placements: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "aenv_scheduler_placements_total",
			Help: "Placement calls this replica answered as the leader, by result (placed, no_capacity, invalid, error).",
		}, []string{"result"}),
		placeDur: prometheus.NewHistogram(prometheus.HistogramOpts{
			Name: "aenv_scheduler_placement_duration_seconds",
			Help: "Time the leader took to choose a node and reserve its resources (the RPC's transport not included).",
			// 5 µs .. ~0.7 s: a placement is a scan of the nodes under one lock.
			Buckets: prometheus.ExponentialBuckets(5e-6, 2.5, 14),
		}),
		heartbeats: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "aenv_scheduler_heartbeats_total",
			Help: "Node heartbeats the leader received, by result (ok, unknown_node: not among the discovered nodes, invalid).",
		}, []string{"result"}),
	}
	cs := []prometheus.Collector{m.placements, m.placeDur, m.heartbeats, &stateCollector{srv: srv}}
	for _, c := range cs {
		if err := reg.Register(c); err != nil {
			return fmt.Errorf("register scheduler metrics: %w", err)
		}
	}
	for _, r := range []string{resultPlaced, resultNoCapacity, resultInvalid, resultError} {
		m.placements.WithLabelValues(r)
	}
	for _, r := range []string{"ok", "unknown_node", "invalid"} {
		m.heartbeats.WithLabelValues(r)
	}
	srv.metrics = m
	return nil
}

func (m *metrics) placed(d time.Duration, err error) {
	if m == nil {
		return
	}
	r := resultPlaced
	switch {
	case err == nil:
		m.placeDur.Observe(d.Seconds())
	case errors.Is(err, ErrNoCapacity):
		r = resultNoCapacity
	case errors.Is(err, ErrInvalid):
		r = resultInvalid
	default:
		r = resultError
	}
	m.placements.WithLabelValues(r).Inc()
}

func (m *metrics) heartbeat(err error) {
	if m == nil {
		return
	}
	r := "ok"
	switch {
	case errors.Is(err, ErrUnknownNode):
		r = "unknown_node"
	case err != nil:
		r = "invalid"
	}
	m.heartbeats.WithLabelValues(r).Inc()
}

// stateCollector reads the cluster's state at scrape time.
type stateCollector struct{ srv *Server }

var (
	descNodes = prometheus.NewDesc("aenv_scheduler_nodes",
		"Nodes the leader knows, by state: ready, draining (drained, stopping or not serving in discovery) or stale (no heartbeat for --stale-after: no placements, sandboxes unreachable). Followers report none.",
		[]string{"state"}, nil)
	descSandboxes = prometheus.NewDesc("aenv_scheduler_sandboxes_bound",
		"Sandboxes bound to a node (lookups answer for them).", nil, nil)
	descReservations = prometheus.NewDesc("aenv_scheduler_reservations",
		"Placements whose resources are held until a bind or a heartbeat shows the sandbox, or they expire.", nil, nil)
	descLeader = prometheus.NewDesc("aenv_scheduler_leader",
		"1 when this replica leads (serves calls from its own state), 0 when it forwards them to the leader.", nil, nil)
)

func (c *stateCollector) Describe(ch chan<- *prometheus.Desc) {
	ch <- descNodes
	ch <- descSandboxes
	ch <- descReservations
	ch <- descLeader
}

func (c *stateCollector) Collect(ch chan<- prometheus.Metric) {
	sum := c.srv.state.Summary()
	for _, st := range []struct {
		label string
		state pb.NodeState
	}{{"ready", pb.NodeState_NODE_STATE_READY}, {"draining", pb.NodeState_NODE_STATE_DRAINING}, {"stale", pb.NodeState_NODE_STATE_STALE}} {
		ch <- prometheus.MustNewConstMetric(descNodes, prometheus.GaugeValue, float64(sum.Nodes[st.state]), st.label)
	}
	ch <- prometheus.MustNewConstMetric(descSandboxes, prometheus.GaugeValue, float64(sum.Bound))
	ch <- prometheus.MustNewConstMetric(descReservations, prometheus.GaugeValue, float64(sum.Reservations))
	leading := 0.0
	if c.srv.Leading() {
		leading = 1
	}
	ch <- prometheus.MustNewConstMetric(descLeader, prometheus.GaugeValue, leading)
}

// Summary is a count of the state, for metrics.
type Summary struct {
	Nodes        map[pb.NodeState]int
	Bound        int
	Reservations int
}

// Summary counts nodes by state, bound sandboxes and held reservations.
func (s *State) Summary() Summary {
	now := s.cfg.Now()
	s.mu.Lock()
	defer s.mu.Unlock()
	sum := Summary{Nodes: map[pb.NodeState]int{}, Bound: len(s.bindings), Reservations: len(s.reserved) + len(s.pending)}
	for _, n := range s.nodes {
		sum.Nodes[s.stateLocked(n, now)]++
	}
	return sum
}
