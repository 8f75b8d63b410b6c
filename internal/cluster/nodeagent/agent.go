// Package nodeagent keeps a node known to the cluster scheduler: it sends heartbeats with
// the node's description, allocations, sandbox roster, templates and layers at the interval
// the scheduler asks for, and says the node is draining when it stops.
package nodeagent

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	pb "github.com/aenv-dev/aenv/internal/cluster/scheduler/gen/schedulerv1"
)

// Report is what the node holds now.
type Report struct {
	Allocated *pb.Resources
	Sandboxes []*pb.SandboxReport
	Templates []string
	Layers    []string
	// Draining asks for no new placements (the node is being drained).
	Draining bool
}

// Source reports the node's current state; the node's assembly implements it.
type Source interface {
	Report(ctx context.Context) (Report, error)
}

// Scheduler is the part of the scheduler client the agent uses.
type Scheduler interface {
	Heartbeat(ctx context.Context, req *pb.HeartbeatRequest, opts ...grpc.CallOption) (*pb.HeartbeatResponse, error)
}

// Agent sends a node's heartbeats.
type Agent struct {
	sched  Scheduler
	node   *pb.NodeInfo
	source Source
	log    *slog.Logger
	// interval is used until the scheduler names its own.
	interval time.Duration
}

// New returns an agent for node, reporting source to sched.
func New(sched Scheduler, node *pb.NodeInfo, source Source, log *slog.Logger) (*Agent, error) {
	if node.GetId() == "" || node.GetEndpoint() == "" {
		return nil, errors.New("nodeagent: the node needs an id and an endpoint")
	}
	if log == nil {
		log = slog.Default()
	}
	return &Agent{sched: sched, node: node, source: source, log: log, interval: 2 * time.Second}, nil
}

// Beat sends one heartbeat and returns the interval the scheduler asks for.
func (a *Agent) Beat(ctx context.Context, draining bool) (time.Duration, error) {
	r, err := a.source.Report(ctx)
	if err != nil {
		return 0, fmt.Errorf("collect the node's report: %w", err)
	}
	resp, err := a.sched.Heartbeat(ctx, &pb.HeartbeatRequest{
		Node: a.node, Allocated: r.Allocated, Sandboxes: r.Sandboxes, Templates: r.Templates, Layers: r.Layers,
		Draining: draining || r.Draining,
	})
	if err != nil {
		return 0, fmt.Errorf("heartbeat to the scheduler: %w", err)
	}
	if ms := resp.GetIntervalMs(); ms > 0 {
		return time.Duration(ms) * time.Millisecond, nil
	}
	return a.interval, nil
}

// Run sends heartbeats until ctx ends, then a last one that marks the node draining so
// no new sandbox is placed on a node that is going away. A scheduler that is down is
// retried at the interval; the first failure and the recovery are logged.
func (a *Agent) Run(ctx context.Context) {
	interval := a.interval
	failing := false
	for {
		hctx, cancel := context.WithTimeout(ctx, max(interval, time.Second))
		d, err := a.Beat(hctx, false)
		cancel()
		switch {
		case err == nil:
			interval = d
			if failing {
				a.log.Info("scheduler reachable again", "node", a.node.Id)
			}
			failing = false
		case ctx.Err() != nil:
		case !failing:
			failing = true
			a.log.Warn("cannot reach the scheduler; retrying", "node", a.node.Id, "err", err, "code", status.Code(err))
		}
		t := time.NewTimer(interval)
		select {
		case <-ctx.Done():
			t.Stop()
			dctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 2*time.Second)
			if _, err := a.Beat(dctx, true); err != nil && status.Code(err) != codes.Unavailable {
				a.log.Debug("last heartbeat (draining)", "err", err)
			}
			cancel()
			return
		case <-t.C:
		}
	}
}
