package main

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"fmt"
	"log/slog"
	"net"
	"os"
	"sync"
	"sync/atomic"
	"time"

	"github.com/aenv-dev/aenv/internal/catalog"
	"github.com/aenv-dev/aenv/internal/cluster/nodeagent"
	"github.com/aenv-dev/aenv/internal/cluster/scheduler"
	pb "github.com/aenv-dev/aenv/internal/cluster/scheduler/gen/schedulerv1"
	"github.com/aenv-dev/aenv/internal/config"
	"github.com/aenv-dev/aenv/internal/envd"
	"github.com/aenv-dev/aenv/internal/node"
	"github.com/aenv-dev/aenv/internal/orchestrator"
	"github.com/aenv-dev/aenv/internal/server"
)

// joinCluster starts the node's heartbeats to cfg.Cluster.Scheduler and returns a stop
// function that sends the last (draining) heartbeat. Without a scheduler it does nothing:
// a lone node behaves exactly as before. With a repository, pauses to disk are published
// so that other nodes can resume them (orchestrator/handoff.go), and the node can be
// drained (POST /aenv/drain).
func joinCluster(ctx context.Context, cfg config.Config, addr net.Addr, n *node.Node, log *slog.Logger) (stop func(), err error) {
	cl := cfg.Cluster
	if cl.Scheduler == "" {
		return func() {}, nil
	}
	info, err := clusterNodeInfo(cfg, addr, n.Backend.Name())
	if err != nil {
		return nil, err
	}
	conn, err := scheduler.Dial(cl.Scheduler)
	if err != nil {
		return nil, fmt.Errorf("cluster.scheduler %s: %w", cl.Scheduler, err)
	}
	report := &nodeReport{orch: n.Orchestrator, cat: n.Catalog}
	drained, err := loadDrained(cfg.DataDir)
	if err != nil {
		conn.Close()
		return nil, err
	}
	if drained {
		// Before the first heartbeat: a drained node that restarts takes no placements.
		report.draining.Store(true)
		log.Warn("this node was drained and stays drained until undrained (aenv nodes undrain)", "node", info.Id)
	}
	if n.P2P != nil {
		info.P2PEndpoint, report.layers = n.P2P.Endpoint, n.P2P.Layers
	}
	log = log.With("component", "cluster")
	agent, err := nodeagent.New(pb.NewSchedulerClient(conn), info, report, log)
	if err != nil {
		conn.Close()
		return nil, err
	}
	actx, cancel := context.WithCancel(context.WithoutCancel(ctx))
	var wg sync.WaitGroup
	if n.Publisher != nil {
		n.Orchestrator.EnableHandoff(n.Publisher, info.Id)
		wg.Add(1)
		go func() { defer wg.Done(); reconcileHandoffs(actx, n.Orchestrator) }()
	} else {
		log.Warn("no repository: sandboxes paused on this node resume on this node only")
	}
	if srv, ok := n.Handler.(*server.Server); ok {
		srv.HandleDrain(info.Id, &drainer{dataDir: cfg.DataDir, report: report, orch: n.Orchestrator, agent: agent, log: log})
	}
	wg.Add(1)
	go func() { defer wg.Done(); agent.Run(actx) }()
	log.Info("joined the cluster", "scheduler", cl.Scheduler, "node", info.Id, "endpoint", info.Endpoint)
	return func() { cancel(); wg.Wait(); conn.Close() }, nil
}

// handoffCheckInterval is how often a node looks for its paused sandboxes that another
// node resumed meanwhile (and forgets them).
const handoffCheckInterval = 5 * time.Second

func reconcileHandoffs(ctx context.Context, orch *orchestrator.Orchestrator) {
	t := time.NewTicker(handoffCheckInterval)
	defer t.Stop()
	for {
		orch.ReconcileHandoffs(ctx)
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
	}
}

func clusterNodeInfo(cfg config.Config, addr net.Addr, backend string) (*pb.NodeInfo, error) {
	cl := cfg.Cluster
	id := cl.NodeID
	if id == "" {
		h, err := os.Hostname()
		if err != nil {
			return nil, fmt.Errorf("name the node: %w (set cluster.node_id)", err)
		}
		id = h
	}
	endpoint := cl.Advertise
	if endpoint == "" {
		tcp, ok := addr.(*net.TCPAddr)
		if !ok || tcp.IP.IsUnspecified() {
			return nil, fmt.Errorf("the node listens on %s, which gateways cannot dial: set cluster.advertise (AENV_CLUSTER_ADVERTISE) to its reachable URL", addr)
		}
		endpoint = "http://" + tcp.String()
	}
	var inst [8]byte
	_, _ = rand.Read(inst[:])
	return &pb.NodeInfo{
		Id:         id,
		Endpoint:   endpoint,
		Backend:    backend,
		Version:    envd.Version,
		InstanceId: hex.EncodeToString(inst[:]),
		Capacity: &pb.Resources{CpuCount: int32(cl.CPUCount), MemoryMb: int64(cl.MemoryMB),
			Sandboxes: int32(cfg.Sandbox.MaxSandboxes)},
	}, nil
}

// nodeReport is the node's state as the scheduler sees it: every sandbox (running ones
// hold CPU and memory; paused ones hold none) and the templates it can create from.
type nodeReport struct {
	orch     *orchestrator.Orchestrator
	cat      *catalog.Catalog
	draining atomic.Bool
	// layers lists the blobs the node serves to peers (nil: peer-to-peer is off).
	layers func() []string
}

func (n *nodeReport) Report(ctx context.Context) (nodeagent.Report, error) {
	var r nodeagent.Report
	alloc := &pb.Resources{}
	f := orchestrator.ListFilter{Limit: orchestrator.MaxListLimit}
	for {
		items, next, err := n.orch.List(ctx, f)
		if err != nil {
			return r, err
		}
		for _, sb := range items {
			st := sb.State.Public()
			res := &pb.Resources{CpuCount: int32(sb.Resources.CPUCount), MemoryMb: int64(sb.Resources.MemoryMB), Sandboxes: 1}
			if st == "running" {
				alloc.CpuCount += res.CpuCount
				alloc.MemoryMb += res.MemoryMb
				alloc.Sandboxes++
			}
			r.Sandboxes = append(r.Sandboxes, &pb.SandboxReport{Id: sb.ID, State: st, TemplateId: sb.TemplateID, Resources: res})
		}
		if next == "" {
			break
		}
		f.NextToken = next
	}
	r.Allocated = alloc
	r.Draining = n.draining.Load()
	if n.layers != nil {
		r.Layers = n.layers()
	}
	ts, err := n.cat.Templates().List("")
	if err != nil {
		return r, err
	}
	for _, t := range ts {
		r.Templates = append(r.Templates, t.ID)
		r.Templates = append(r.Templates, t.Aliases...)
	}
	return r, nil
}
