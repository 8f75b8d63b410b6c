package integration

import (
	"context"
	"fmt"
	"os"
	"os/exec"
	"syscall"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/status"

	"github.com/aenv-dev/aenv/internal/bench"
	pb "github.com/aenv-dev/aenv/internal/cluster/scheduler/gen/schedulerv1"
)

// daemon is an `aenv scheduler` or `aenv gateway` subprocess.
type daemon struct {
	addr string
	cmd  *exec.Cmd
	log  *syncBuffer
}

// startDaemon runs `aenv <args...>` until the test ends and waits until ready answers true.
func startDaemon(t *testing.T, bins binaries, env []string, ready func() bool, args ...string) *daemon {
	t.Helper()
	d := &daemon{log: &syncBuffer{}}
	d.cmd = exec.Command(bins.aenv, args...)
	d.cmd.Env = append(os.Environ(), env...)
	d.cmd.Stdout, d.cmd.Stderr = d.log, d.log
	d.cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
	if err := d.cmd.Start(); err != nil {
		t.Fatalf("start aenv %s: %v", args[0], err)
	}
	t.Cleanup(func() {
		_ = d.cmd.Process.Kill()
		_ = d.cmd.Wait()
		if t.Failed() {
			t.Logf("aenv %s output:\n%s", args[0], d.log.String())
		}
	})
	deadline := time.Now().Add(30 * time.Second)
	for !ready() {
		if time.Now().After(deadline) {
			t.Fatalf("aenv %s not ready within 30 s:\n%s", args[0], d.log.String())
		}
		time.Sleep(50 * time.Millisecond)
	}
	return d
}

// startScheduler runs `aenv scheduler` on a free loopback port with a short heartbeat
// interval, and returns it with a client.
func startScheduler(t *testing.T, bins binaries) (*daemon, pb.SchedulerClient) {
	t.Helper()
	return startSchedulerOn(t, bins, fmt.Sprintf("127.0.0.1:%d", freePort(t)))
}

// startSchedulerOn is startScheduler listening on addr.
func startSchedulerOn(t *testing.T, bins binaries, addr string) (*daemon, pb.SchedulerClient) {
	t.Helper()
	conn, err := grpc.NewClient(addr, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { conn.Close() })
	c := pb.NewSchedulerClient(conn)
	d := startDaemon(t, bins, nil, func() bool {
		ctx, cancel := context.WithTimeout(context.Background(), time.Second)
		defer cancel()
		_, err := c.ListNodes(ctx, &pb.ListNodesRequest{})
		return err == nil
	}, "scheduler", "--listen", addr, "--heartbeat-interval", "500ms", "--stale-after", "3s")
	d.addr = addr
	return d, c
}

// clusterNode is a node joined to the scheduler at sched, under the given id and key.
func clusterNode(t *testing.T, sched, id, key string, env ...string) *node {
	t.Helper()
	n := newNode(t, append([]string{"AENV_CLUSTER_SCHEDULER=" + sched, "AENV_CLUSTER_NODE_ID=" + id}, env...)...)
	n.key = key
	n.start()
	return n
}

func waitLookup(ctx context.Context, t *testing.T, c pb.SchedulerClient, sandboxID string, want codes.Code, node string) {
	t.Helper()
	var last error
	deadline := time.Now().Add(15 * time.Second)
	for time.Now().Before(deadline) {
		l, err := c.Lookup(ctx, &pb.LookupRequest{SandboxId: sandboxID})
		last = err
		if status.Code(err) == want && (want != codes.OK || l.Node.Id == node) {
			return
		}
		time.Sleep(100 * time.Millisecond)
	}
	t.Fatalf("Lookup(%s): last %v, want %v on %q", sandboxID, last, want, node)
}

// A node started with a scheduler registers, reports its sandboxes through heartbeats and
// says it is draining when it stops; a lone node (every other test) is unchanged.
func TestNodeJoinsCluster(t *testing.T) {
	bins := needNode(t)
	sd, sc := startScheduler(t, bins)
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	n := clusterNode(t, sd.addr, "it-node-a", "e2b_"+randHex(20), "AENV_CLUSTER_CPU_COUNT=8")

	var nodes *pb.ListNodesResponse
	deadline := time.Now().Add(15 * time.Second)
	for {
		var err error
		nodes, err = sc.ListNodes(ctx, &pb.ListNodesRequest{})
		if err == nil && len(nodes.Nodes) == 1 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("the node did not register: %v, %v", nodes, err)
		}
		time.Sleep(100 * time.Millisecond)
	}
	got := nodes.Nodes[0]
	if got.Node.Id != "it-node-a" || got.Node.Endpoint != n.url() || got.Node.Backend != "oci" ||
		got.Node.Capacity.CpuCount != 8 || got.State != pb.NodeState_NODE_STATE_READY {
		t.Fatalf("registered node = %v", got)
	}

	c := n.client()
	sb, err := c.Create(ctx, bench.CreateRequest{TemplateID: "base-minimal", Timeout: 120})
	if err != nil {
		t.Fatal(err)
	}
	waitLookup(ctx, t, sc, sb.ID, codes.OK, "it-node-a")
	if err := c.Kill(ctx, sb.ID); err != nil {
		t.Fatal(err)
	}
	waitLookup(ctx, t, sc, sb.ID, codes.NotFound, "")

	// A graceful stop marks the node draining at once: no placements while it goes away.
	stopped := make(chan error, 1)
	go func() { stopped <- n.signal(syscall.SIGTERM, 90*time.Second) }()
	deadline = time.Now().Add(10 * time.Second)
	for {
		nodes, err := sc.ListNodes(ctx, &pb.ListNodesRequest{})
		if err == nil && len(nodes.Nodes) == 1 && nodes.Nodes[0].State == pb.NodeState_NODE_STATE_DRAINING {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("the stopping node is not draining: %v, %v", nodes, err)
		}
		time.Sleep(50 * time.Millisecond)
	}
	if _, err := sc.Place(ctx, &pb.PlaceRequest{}); status.Code(err) != codes.ResourceExhausted {
		t.Fatalf("Place with the only node draining: %v, want ResourceExhausted", err)
	}
	if err := <-stopped; err != nil {
		t.Fatalf("stop the node: %v", err)
	}
}

// A drained node that restarts stays drained (the drain is kept in its data dir) from its
// first heartbeat on, until it is undrained; an undrained node that restarts takes
// placements again.
func TestDrainSurvivesRestart(t *testing.T) {
	bins := needNode(t)
	sd, sc := startScheduler(t, bins)
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	const id = "it-drain-restart"
	n := clusterNode(t, sd.addr, id, "e2b_"+randHex(20))
	waitNodeState(ctx, t, sc, id, pb.NodeState_NODE_STATE_READY)

	// restart stops the node and starts it again, and returns its first heartbeat's state.
	restart := func() pb.NodeState {
		t.Helper()
		before := nodeInstance(ctx, t, sc, id)
		n.stop()
		n.start()
		deadline := time.Now().Add(20 * time.Second)
		for time.Now().Before(deadline) {
			l, err := sc.ListNodes(ctx, &pb.ListNodesRequest{})
			if err == nil {
				for _, s := range l.Nodes {
					if s.Node.Id == id && s.Node.InstanceId != before {
						return s.State
					}
				}
			}
			time.Sleep(50 * time.Millisecond)
		}
		t.Fatalf("the restarted node %s did not heartbeat", id)
		return 0
	}

	if code, out := n.post(ctx, t, "/aenv/drain", `{"draining":true}`, false); code != 200 {
		t.Fatalf("drain: %d %s", code, out)
	}
	waitNodeState(ctx, t, sc, id, pb.NodeState_NODE_STATE_DRAINING)
	if st := restart(); st != pb.NodeState_NODE_STATE_DRAINING {
		t.Fatalf("a drained node restarted as %v, want DRAINING", st)
	}
	if _, err := sc.Place(ctx, &pb.PlaceRequest{}); status.Code(err) != codes.ResourceExhausted {
		t.Fatalf("Place with the only node drained and restarted: %v, want ResourceExhausted", err)
	}

	if code, out := n.post(ctx, t, "/aenv/drain", `{"draining":false}`, false); code != 200 {
		t.Fatalf("undrain: %d %s", code, out)
	}
	waitNodeState(ctx, t, sc, id, pb.NodeState_NODE_STATE_READY)
	if st := restart(); st != pb.NodeState_NODE_STATE_READY {
		t.Fatalf("an undrained node restarted as %v, want READY", st)
	}
	if p, err := sc.Place(ctx, &pb.PlaceRequest{}); err != nil || p.Node.Id != id {
		t.Fatalf("Place after undrain and restart = %v, %v", p, err)
	}
}

// nodeInstance is the instance id of node id's last heartbeat.
func nodeInstance(ctx context.Context, t *testing.T, c pb.SchedulerClient, id string) string {
	t.Helper()
	l, err := c.ListNodes(ctx, &pb.ListNodesRequest{})
	if err != nil {
		t.Fatal(err)
	}
	for _, s := range l.Nodes {
		if s.Node.Id == id {
			return s.Node.InstanceId
		}
	}
	t.Fatalf("node %s is not registered", id)
	return ""
}
