package integration

import (
	"context"
	"fmt"
	"net/http"
	"os"
	"strings"
	"sync"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/aenv-dev/aenv/internal/bench"
	"github.com/aenv-dev/aenv/internal/cluster/kube/kubetest"
	"github.com/aenv-dev/aenv/internal/cluster/scheduler"
	pb "github.com/aenv-dev/aenv/internal/cluster/scheduler/gen/schedulerv1"
)

// haCluster is the whole cluster of the issue, each part a separate process: three nodes,
// each in its own network namespace with its own address on a test bridge, sharing a
// posix_fs repository with peer-to-peer layer distribution on; two schedulers listening on
// the bridge that elect a leader through a Lease on a real API server (etcd +
// kube-apiserver); a gateway on loopback talking to both.
type haCluster struct {
	*netCluster
	kube   *kubetest.Cluster
	lease  string
	scheds map[string]*daemon // by gRPC address
	repo   string
	ids    []string // node ids, in start order
}

// haP2PPort is the peer listener's port on every node (each node has its own address).
const haP2PPort = 7070

func startHACluster(t *testing.T) *haCluster {
	t.Helper()
	bins := needNode(t)
	repo, err := os.MkdirTemp("", "aenv-it-ha-repo-")
	if err != nil {
		t.Fatal(err)
	}
	// Registered before the nodes, so it runs after they are gone.
	t.Cleanup(func() { os.RemoveAll(repo) })
	br := newTestBridge(t)
	c := &haCluster{lease: "aenv-it-ha", scheds: map[string]*daemon{}, repo: repo}
	addrs := []string{fmt.Sprintf("%s:%d", br.hostIP(), freePort(t)), fmt.Sprintf("%s:%d", br.hostIP(), freePort(t))}
	both := strings.Join(addrs, ",")
	conn, err := scheduler.Dial(both)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { conn.Close() })
	c.netCluster = &netCluster{cluster: &cluster{sched: pb.NewSchedulerClient(conn), nodes: map[string]*node{},
		key: "e2b_" + randHex(20), bins: bins}, netns: map[string]string{}}

	// The nodes start side by side, and meanwhile the API server and the schedulers (a
	// node retries its heartbeats until a scheduler answers).
	token := randHex(16)
	for i := range 3 {
		id := fmt.Sprintf("it-ha-%d", i)
		ns, ip := br.addNetns(t, i)
		n := newNode(t, "AENV_CLUSTER_SCHEDULER="+both, "AENV_CLUSTER_NODE_ID="+id,
			"AENV_CLUSTER_CPU_COUNT=64", "AENV_CLUSTER_MEMORY_MB=65536",
			"AENV_REPOSITORY_POSIX_FS_PATH="+repo, "AENV_SNAPSHOT_SYNC_INTERVAL=1s", "AENV_SNAPSHOT_LAZY_LAYERS=true",
			"AENV_SANDBOX_SHUTDOWN_ACTION=stop",
			"AENV_CLUSTER_P2P_ENABLED=true", "AENV_CLUSTER_P2P_TOKEN="+token, "AENV_CLUSTER_P2P_TIMEOUT=30s",
			fmt.Sprintf("AENV_CLUSTER_P2P_LISTEN=%s:%d", ip, haP2PPort))
		n.key, n.netns, n.addr = c.key, ns, ip+":3000" // the same port on every node: each has its own address
		n.launch()
		c.ids = append(c.ids, id)
		c.nodes[id], c.netns[id] = n, ns
	}
	c.kube = kubetest.Start(t)
	for _, addr := range addrs {
		c.scheds[addr] = startHAScheduler(t, bins, c.kube, addr, c.lease, c.ids)
	}
	for _, id := range c.ids {
		c.nodes[id].waitHealthy()
	}
	c.gateway = startGateway(t, bins, c.key, both)
	waitUntil(t, 30*time.Second, "a leader and every node registered", func() error {
		if c.leader(context.Background()) == "" {
			return fmt.Errorf("no Lease holder")
		}
		l, err := c.sched.ListNodes(context.Background(), &pb.ListNodesRequest{})
		if err != nil || len(l.Nodes) != len(c.ids) {
			return fmt.Errorf("nodes %v, %v", l, err)
		}
		return nil
	})
	return c
}

// startHAScheduler runs one scheduler replica on addr, electing through lease, with the
// nodes listed statically.
func startHAScheduler(t *testing.T, bins binaries, kc *kubetest.Cluster, addr, lease string, nodes []string) *daemon {
	t.Helper()
	conn, err := grpc.NewClient(addr, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { conn.Close() })
	hc := healthpb.NewHealthClient(conn)
	d := startDaemon(t, bins, nil, func() bool {
		ctx, cancel := context.WithTimeout(context.Background(), time.Second)
		defer cancel()
		r, err := hc.Check(ctx, &healthpb.HealthCheckRequest{})
		return err == nil && r.Status == healthpb.HealthCheckResponse_SERVING
	}, "scheduler", "--listen", addr, "--heartbeat-interval", "500ms", "--stale-after", "3s",
		"--kubeconfig", kc.Kubeconfig, "--namespace", "default", "--lease", lease,
		"--lease-duration", "4s", "--renew-deadline", "3s", "--retry-period", "250ms", "--nodes", strings.Join(nodes, ","))
	d.addr = addr
	return d
}

// leader is the address of the replica holding the Lease, or "" when none does.
func (c *haCluster) leader(ctx context.Context) string {
	l, err := c.kube.Client.CoordinationV1().Leases("default").Get(ctx, c.lease, metav1.GetOptions{})
	if err != nil || l.Spec.HolderIdentity == nil {
		return ""
	}
	addr, _, _ := strings.Cut(*l.Spec.HolderIdentity, "#")
	return addr
}

// TestClusterNetns runs the cluster of the issue as separate processes (three nodes, each
// in its own network namespace with its own address, two schedulers electing a leader
// through a Lease on a real API server, a gateway) and, one after the other on it:
//   - creates through the gateway spread over the nodes, whose sandboxes answer; `aenv
//     nodes` lists the nodes and the merged list pages correctly through the gateway (the
//     gateway's overhead per call is logged);
//   - P2P: a layer published on one node is read by the other two from it, and a chunk
//     corrupted in its copy is detected and read from the repository instead;
//   - the scheduler leader is killed: the other replica takes the Lease and routing
//     recovers from the nodes' heartbeats;
//   - a node cut off with nftables goes stale (its sandboxes answer 503, creates go
//     elsewhere) and rejoins once the rule is gone;
//   - a node is killed with SIGKILL: its sandboxes are reported lost, creates go elsewhere,
//     the list still answers, an unknown sandbox is a 404,
//     a sandbox it paused to disk resumes on another node through the gateway, and the
//     node, restarted, forgets that sandbox and serves the ones that survived.
func TestClusterNetns(t *testing.T) {
	start := time.Now()
	c := startHACluster(t)
	ctx, cancel := context.WithTimeout(context.Background(), 8*time.Minute)
	defer cancel()
	gw := c.client(t)
	for id, n := range c.nodes {
		if !sameNetns(t, n.pid(), c.netns[id]) {
			t.Fatalf("node %s does not run in namespace %s", id, c.netns[id])
		}
	}
	l, err := c.sched.ListNodes(ctx, &pb.ListNodesRequest{})
	if err != nil {
		t.Fatal(err)
	}
	for _, st := range l.Nodes {
		if want := c.nodes[st.Node.Id].url(); st.Node.Endpoint != want {
			t.Fatalf("node %s registered endpoint %s, want its own address %s", st.Node.Id, st.Node.Endpoint, want)
		}
	}
	sbs := &sandboxSet{}
	t.Cleanup(func() { sbs.killAll(gw) })
	t.Logf("cluster up in %v", time.Since(start).Round(time.Millisecond))

	step := func(name string, fn func()) {
		t.Helper()
		s := time.Now()
		fn()
		t.Logf("step %s: %v", name, time.Since(s).Round(time.Millisecond))
	}
	step("spread", func() { c.spread(ctx, t, gw, sbs) })
	step("p2p", func() { c.p2p(ctx, t, sbs) })
	step("scheduler failover", func() { c.failover(ctx, t, gw, sbs) })
	step("partition", func() { c.partitionNode(ctx, t, gw, sbs) })
	step("kill -9 a node", func() { c.killNode(ctx, t, gw, sbs) })
	step("teardown", func() { c.teardown(ctx, t, gw, sbs) })
}

// teardown kills every sandbox and stops every node gracefully: each leaves nothing behind
// (containers, mounts, loop devices, namespaces, cgroups), the one restarted after its
// SIGKILL included.
func (c *haCluster) teardown(ctx context.Context, t *testing.T, gw *bench.Client, sbs *sandboxSet) {
	sbs.killAll(gw)
	for _, id := range c.ids {
		n := c.nodes[id]
		killAll(ctx, t, n.client())
		n.stop()
		requireNoLeftovers(t, n, nil)
	}
}

// sandboxSet is what the test created, killed through the gateway when it ends.
type sandboxSet struct {
	mu  sync.Mutex
	all []bench.Sandbox
}

func (s *sandboxSet) add(sb bench.Sandbox) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.all = append(s.all, sb)
}

func (s *sandboxSet) list() []bench.Sandbox {
	s.mu.Lock()
	defer s.mu.Unlock()
	return append([]bench.Sandbox(nil), s.all...)
}

// killAll kills every sandbox, four at a time (errors are ignored: some are gone), and
// empties the set.
func (s *sandboxSet) killAll(gw *bench.Client) {
	s.mu.Lock()
	all := s.all
	s.all = nil
	s.mu.Unlock()
	sem := make(chan struct{}, 4)
	var wg sync.WaitGroup
	for _, sb := range all {
		wg.Add(1)
		sem <- struct{}{}
		go func() {
			defer wg.Done()
			defer func() { <-sem }()
			ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
			defer cancel()
			_ = gw.Kill(ctx, sb.ID)
		}()
	}
	wg.Wait()
}

// createVia creates a base-minimal sandbox through the gateway and records it.
func (c *haCluster) createVia(ctx context.Context, t *testing.T, gw *bench.Client, sbs *sandboxSet, secure bool) bench.Sandbox {
	t.Helper()
	sb, err := gw.Create(ctx, bench.CreateRequest{TemplateID: "base-minimal", Timeout: 600, Secure: secure})
	if err != nil {
		t.Fatalf("create through the gateway: %v", err)
	}
	sbs.add(sb)
	return sb
}

// spread creates sandboxes through the gateway, 4 at a time (the creates per second
// across the three nodes are logged), checks every node got some, and runs a command in
// one sandbox of each node through the gateway.
func (c *haCluster) spread(ctx context.Context, t *testing.T, gw *bench.Client, sbs *sandboxSet) {
	const creates, workers = 12, 4
	jobs := make(chan struct{}, creates)
	for range creates {
		jobs <- struct{}{}
	}
	close(jobs)
	var (
		wg   sync.WaitGroup
		mu   sync.Mutex
		made []bench.Sandbox
	)
	errs := make(chan error, creates)
	start := time.Now()
	for range workers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for range jobs {
				sb, err := gw.Create(ctx, bench.CreateRequest{TemplateID: "base-minimal", Timeout: 600})
				if err != nil {
					errs <- err
					continue
				}
				sbs.add(sb)
				mu.Lock()
				made = append(made, sb)
				mu.Unlock()
			}
		}()
	}
	wg.Wait()
	took := time.Since(start)
	close(errs)
	for err := range errs {
		t.Fatalf("create through the gateway: %v", err)
	}
	perNode := map[string][]bench.Sandbox{}
	for _, sb := range made {
		n := c.nodeOf(ctx, t, sb.ID)
		perNode[n] = append(perNode[n], sb)
	}
	counts := map[string]int{}
	for n, s := range perNode {
		counts[n] = len(s)
	}
	t.Logf("%d creates through the gateway, %d at a time, over 3 nodes in their own namespaces: %v (%.1f creates/s); placement %v",
		creates, workers, took.Round(time.Millisecond), float64(creates)/took.Seconds(), counts)
	if len(perNode) != 3 {
		t.Fatalf("%d creates on 3 idle nodes used only %v", creates, counts)
	}
	for n, s := range perNode {
		if got := run(ctx, t, gw, s[0], "echo $((6*7)) from $(hostname)"); !strings.HasPrefix(got, "42 from") {
			t.Fatalf("a command in %s on %s through the gateway printed %q", s[0].ID, n, got)
		}
	}
	checkNodesCLI(ctx, t, c.cluster, 3)
	ids := make([]string, len(made))
	for i, sb := range made {
		ids[i] = sb.ID
	}
	checkPages(ctx, t, c.cluster, ids)
	measureOverhead(ctx, t, c.cluster, made[1])
}

// gwStatus is the HTTP status and body of GET /sandboxes/{id} through the gateway.
func (c *haCluster) gwStatus(ctx context.Context, t *testing.T, id string) (int, string) {
	t.Helper()
	code, body, _ := c.get(ctx, t, "/sandboxes/"+id)
	return code, string(body)
}

// failover kills the scheduler leader with SIGKILL (it cannot release the Lease): the other
// replica takes the Lease once it expires, learns the cluster from the nodes' heartbeats,
// and the gateway finds every sandbox on its node again and places new ones.
func (c *haCluster) failover(ctx context.Context, t *testing.T, gw *bench.Client, sbs *sandboxSet) {
	before := map[string]string{}
	for _, sb := range sbs.list() {
		before[sb.ID] = c.nodeOf(ctx, t, sb.ID)
	}
	old := c.leader(ctx)
	d := c.scheds[old]
	if d == nil {
		t.Fatalf("the Lease holder %q is none of the schedulers", old)
	}
	killed := time.Now()
	if err := d.cmd.Process.Kill(); err != nil {
		t.Fatal(err)
	}
	var survivor string
	for a := range c.scheds {
		if a != old {
			survivor = a
		}
	}
	waitUntil(t, 30*time.Second, "the other replica takes the Lease", func() error {
		if h := c.leader(ctx); h != survivor {
			return fmt.Errorf("holder %q", h)
		}
		return nil
	})
	took := time.Since(killed)
	waitUntil(t, 30*time.Second, "routing to every sandbox recovers", func() error {
		for id := range before {
			if code, body := c.gwStatus(ctx, t, id); code != http.StatusOK {
				return fmt.Errorf("GET /sandboxes/%s through the gateway: %d %s", id, code, body)
			}
		}
		return nil
	})
	recovered := time.Since(killed)
	for id, n := range before {
		if got := c.nodeOf(ctx, t, id); got != n {
			t.Fatalf("after the failover %s is bound to %s, before to %s", id, got, n)
		}
	}
	l, err := c.sched.ListNodes(ctx, &pb.ListNodesRequest{})
	if err != nil || len(l.Nodes) != len(c.ids) {
		t.Fatalf("nodes on the new leader: %v, %v", l, err)
	}
	sb := c.createVia(ctx, t, gw, sbs, false)
	if got := run(ctx, t, gw, sb, "echo after-failover"); got != "after-failover" {
		t.Fatalf("a sandbox created after the failover printed %q", got)
	}
	t.Logf("leader killed: Lease taken over after %v, routing to %d sandboxes on 3 nodes recovered after %v (lease duration 4 s)",
		took.Round(time.Millisecond), len(before), recovered.Round(time.Millisecond))
}

// waitUntil polls cond until it succeeds or d passes.
func waitUntil(t *testing.T, d time.Duration, what string, cond func() error) {
	t.Helper()
	deadline := time.Now().Add(d)
	for {
		err := cond()
		if err == nil {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("%s: %v", what, err)
		}
		time.Sleep(100 * time.Millisecond)
	}
}
