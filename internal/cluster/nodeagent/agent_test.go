package nodeagent

import (
	"context"
	"net"
	"sync"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"

	"github.com/aenv-dev/aenv/internal/cluster/scheduler"
	pb "github.com/aenv-dev/aenv/internal/cluster/scheduler/gen/schedulerv1"
)

// roster is a Source whose report the test changes.
type roster struct {
	mu sync.Mutex
	r  Report
}

func (s *roster) Report(context.Context) (Report, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.r, nil
}

func (s *roster) set(ids ...string) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.r.Sandboxes = nil
	for _, id := range ids {
		s.r.Sandboxes = append(s.r.Sandboxes, &pb.SandboxReport{Id: id, State: "running"})
	}
}

func waitFor(t *testing.T, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out waiting for %s", what)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

func TestAgentAgainstScheduler(t *testing.T) {
	state := scheduler.New(scheduler.Config{HeartbeatInterval: 50 * time.Millisecond})
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	g := grpc.NewServer()
	scheduler.NewServer(state, nil).Register(g)
	go g.Serve(ln)
	defer g.Stop()
	conn, err := grpc.NewClient(ln.Addr().String(), grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()

	src := &roster{}
	src.set("sb-1")
	a, err := New(pb.NewSchedulerClient(conn), &pb.NodeInfo{Id: "n1", Endpoint: "http://127.0.0.1:1", InstanceId: "i"}, src, nil)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { a.Run(ctx); close(done) }()

	waitFor(t, "sb-1 bound to n1", func() bool { l, err := state.Lookup("sb-1"); return err == nil && l.Node.Id == "n1" })
	src.set("sb-2")
	waitFor(t, "the roster to replace sb-1 by sb-2", func() bool {
		_, gone := state.Lookup("sb-1")
		l, err := state.Lookup("sb-2")
		return gone != nil && err == nil && l.Node.Id == "n1"
	})
	cancel()
	<-done
	if n := state.Nodes(); len(n) != 1 || n[0].State != pb.NodeState_NODE_STATE_DRAINING {
		t.Fatalf("after the agent stopped: %v, want n1 draining", n)
	}
}

func TestNewRejectsIncompleteNode(t *testing.T) {
	if _, err := New(nil, &pb.NodeInfo{Id: "x"}, &roster{}, nil); err == nil {
		t.Fatal("a node without an endpoint was accepted")
	}
}
