package scheduler

import (
	"context"
	"net"
	"strings"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"
	"google.golang.org/grpc/status"

	pb "github.com/aenv-dev/aenv/internal/cluster/scheduler/gen/schedulerv1"
)

// replicaServer is one scheduler replica on a loopback port.
type replicaServer struct {
	addr  string
	srv   *Server
	state *State
}

func startReplica(t *testing.T) *replicaServer {
	t.Helper()
	s, _ := newTestState(t)
	srv := NewServer(s, nil)
	t.Cleanup(srv.Close)
	return &replicaServer{addr: serveGRPC(t, srv), srv: srv, state: s}
}

func mustDial(t *testing.T, target string) *grpc.ClientConn {
	t.Helper()
	conn, err := Dial(target)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { conn.Close() })
	return conn
}

func dialT(t *testing.T, target string) pb.SchedulerClient {
	return pb.NewSchedulerClient(mustDial(t, target))
}

func TestFollowerForwards(t *testing.T) {
	a, b := startReplica(t), startReplica(t)
	b.srv.Follow(a.addr)
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	viaB := dialT(t, b.addr)

	watch, err := viaB.Watch(ctx, &pb.WatchRequest{})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := watch.Header(); err != nil {
		t.Fatal(err)
	}
	if _, err := viaB.Heartbeat(ctx, hb{id: "n1", cpu: 4, mem: 4096}.req()); err != nil {
		t.Fatal(err)
	}
	if len(a.state.Nodes()) != 1 || len(b.state.Nodes()) != 0 {
		t.Fatalf("the heartbeat must land on the leader only: leader %d nodes, follower %d", len(a.state.Nodes()), len(b.state.Nodes()))
	}
	p, err := viaB.Place(ctx, &pb.PlaceRequest{Resources: &pb.Resources{CpuCount: 1}})
	if err != nil || p.Node.Id != "n1" {
		t.Fatalf("Place through the follower = %v, %v", p, err)
	}
	if _, err := viaB.Bind(ctx, &pb.BindRequest{SandboxId: "sb", NodeId: "n1", ReservationId: p.ReservationId}); err != nil {
		t.Fatal(err)
	}
	l, err := viaB.Lookup(ctx, &pb.LookupRequest{SandboxId: "sb"})
	if err != nil || l.Node.Id != "n1" {
		t.Fatalf("Lookup through the follower = %v, %v", l, err)
	}
	// The leader's errors come back as they are.
	if _, err := viaB.Lookup(ctx, &pb.LookupRequest{SandboxId: "nope"}); status.Code(err) != codes.NotFound {
		t.Fatalf("Lookup of an unknown sandbox through the follower = %v, want NotFound", err)
	}
	// The relayed event stream carries the leader's events.
	for _, want := range []pb.Event_Type{pb.Event_TYPE_NODE_UP, pb.Event_TYPE_SANDBOX_BOUND} {
		e, err := watch.Recv()
		if err != nil || e.Type != want {
			t.Fatalf("relayed event = %v, %v; want %v", e, err, want)
		}
	}

	// The leader steps down: its streams end, it forwards nowhere until it learns of a new
	// leader, and the new leader starts empty and warming up.
	a.srv.Follow("")
	// Health is every replica's own: a follower with no leader is still up.
	if r, err := healthpb.NewHealthClient(mustDial(t, a.addr)).Check(ctx, &healthpb.HealthCheckRequest{}); err != nil ||
		r.Status != healthpb.HealthCheckResponse_SERVING {
		t.Fatalf("health of a follower = %v, %v", r, err)
	}
	if _, err := watch.Recv(); status.Code(err) != codes.Unavailable {
		t.Fatalf("a watch on a leader that stepped down = %v, want Unavailable", err)
	}
	viaA := dialT(t, a.addr)
	if _, err := viaA.ListNodes(ctx, &pb.ListNodesRequest{}); status.Code(err) != codes.Unavailable || !strings.Contains(err.Error(), "no scheduler replica leads") {
		t.Fatalf("a call while no replica leads = %v", err)
	}
	b.srv.Lead()
	a.srv.Follow(b.addr)
	if _, err := viaA.Lookup(ctx, &pb.LookupRequest{SandboxId: "sb"}); status.Code(err) != codes.Unavailable {
		t.Fatalf("Lookup on a new leader before any heartbeat = %v, want Unavailable (warming up)", err)
	}
	if _, err := viaA.Heartbeat(ctx, hb{id: "n1", cpu: 4, mem: 4096, sandboxes: []string{"sb"}}.req()); err != nil {
		t.Fatal(err)
	}
	if l, err := viaA.Lookup(ctx, &pb.LookupRequest{SandboxId: "sb"}); err != nil || l.Node.Id != "n1" {
		t.Fatalf("Lookup after the new leader's first heartbeat = %v, %v", l, err)
	}
	if len(a.state.Nodes()) != 0 {
		t.Fatal("the replica that stepped down kept its state")
	}
}

func TestForwardLoopRefused(t *testing.T) {
	a, b := startReplica(t), startReplica(t)
	// Each believes the other leads (a moment of a Lease changing hands).
	a.srv.Follow(b.addr)
	b.srv.Follow(a.addr)
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	_, err := dialT(t, a.addr).ListNodes(ctx, &pb.ListNodesRequest{})
	if status.Code(err) != codes.Unavailable || !strings.Contains(err.Error(), "does not lead") {
		t.Fatalf("a call bouncing between followers = %v, want Unavailable from the second hop", err)
	}
}

func TestDialSkipsDeadReplica(t *testing.T) {
	a := startReplica(t)
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	dead := ln.Addr().String()
	ln.Close()
	c := dialT(t, dead+", "+a.addr)
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	for i := 0; i < 10; i++ {
		if _, err := c.ListNodes(ctx, &pb.ListNodesRequest{}); err != nil {
			t.Fatalf("call %d with one replica down: %v", i, err)
		}
	}
	if _, err := Dial(" , "); err == nil || !strings.Contains(err.Error(), "no scheduler address") {
		t.Fatalf("Dial of an empty list = %v", err)
	}
}
