package integration

import (
	"context"
	"crypto/rand"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"os/exec"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/aenv-dev/aenv/internal/bench"
	pb "github.com/aenv-dev/aenv/internal/cluster/scheduler/gen/schedulerv1"
)

// testBridge is a bridge in the test's namespace holding 10.213.K.1/24, K unique on the
// host: nodes in namespaces of their own join it with a veth pair and get 10.213.K.(10+i).
// 10.213.0.0/16 is private and away from the host's own 192.0.2.0/24.
type testBridge struct {
	name string
	k    int
}

func newTestBridge(t *testing.T) *testBridge {
	t.Helper()
	used := map[string]bool{}
	if addrs, err := net.InterfaceAddrs(); err == nil {
		for _, a := range addrs {
			used[a.String()] = true
		}
	}
	for range 100 {
		var b [1]byte
		if _, err := rand.Read(b[:]); err != nil {
			t.Fatal(err)
		}
		k := 1 + int(b[0])%250
		name := fmt.Sprintf("aitcn%d", k)
		if _, err := os.Stat("/sys/class/net/" + name); err == nil {
			continue
		}
		if used[fmt.Sprintf("10.213.%d.1/24", k)] {
			continue
		}
		br := &testBridge{name: name, k: k}
		t.Cleanup(func() { _ = exec.Command("ip", "link", "del", name).Run() })
		ipCmd(t, "link", "add", name, "type", "bridge")
		ipCmd(t, "addr", "add", br.hostIP()+"/24", "dev", name)
		ipCmd(t, "link", "set", name, "up")
		return br
	}
	t.Fatal("no free test bridge name")
	return nil
}

// hostIP is the test namespace's address on the bridge (schedulers listen there).
func (b *testBridge) hostIP() string { return fmt.Sprintf("10.213.%d.1", b.k) }

// addNetns makes namespace i on the bridge and returns its name and address. It and its
// veth pair go when the test ends (registered before the node, so after it is killed).
func (b *testBridge) addNetns(t *testing.T, i int) (ns, ip string) {
	t.Helper()
	ns, ip = fmt.Sprintf("aitcn%d-n%d", b.k, i), fmt.Sprintf("10.213.%d.%d", b.k, 10+i)
	veth := fmt.Sprintf("aitcn%dv%d", b.k, i)
	remoteNetns(t, ns, veth)
	ipCmd(t, "link", "set", veth, "master", b.name)
	ipCmd(t, "-n", ns, "addr", "add", ip+"/24", "dev", "eth0")
	ipCmd(t, "-n", ns, "route", "add", "default", "via", b.hostIP())
	return ns, ip
}

// netCluster is a cluster whose nodes each run in a network namespace of their own,
// listening on their own address on a test bridge; the scheduler listens on the bridge
// and the gateway on loopback.
type netCluster struct {
	*cluster
	netns map[string]string // node id → its namespace
}

func startNetCluster(t *testing.T, nodes int, env ...string) *netCluster {
	t.Helper()
	bins := needNode(t)
	br := newTestBridge(t)
	sd, sc := startSchedulerOn(t, bins, fmt.Sprintf("%s:%d", br.hostIP(), freePort(t)))
	c := &netCluster{cluster: &cluster{sched: sc, nodes: map[string]*node{}, key: "e2b_" + randHex(20), bins: bins},
		netns: map[string]string{}}
	for i := range nodes {
		id := fmt.Sprintf("it-netns-%d", i)
		ns, ip := br.addNetns(t, i)
		n := newNode(t, append([]string{"AENV_CLUSTER_SCHEDULER=" + sd.addr, "AENV_CLUSTER_NODE_ID=" + id}, env...)...)
		n.key, n.netns, n.addr = c.key, ns, ip+":3000" // the same port on every node: each has its own address
		n.start()
		c.nodes[id], c.netns[id] = n, ns
	}
	c.gateway = startGateway(t, bins, c.key, sd.addr)
	waitNodes(t, sc, nodes)
	return c
}

// startGateway runs `aenv gateway` on a loopback port and returns its base URL.
func startGateway(t *testing.T, bins binaries, key, sched string) string {
	t.Helper()
	addr := fmt.Sprintf("127.0.0.1:%d", freePort(t))
	startDaemon(t, bins, []string{"AENV_API_KEY=" + key}, func() bool {
		resp, err := http.Get("http://" + addr + "/health")
		if err != nil {
			return false
		}
		resp.Body.Close()
		return resp.StatusCode == http.StatusNoContent
	}, "gateway", "--listen", addr, "--scheduler", sched)
	return "http://" + addr
}

func waitNodes(t *testing.T, sc pb.SchedulerClient, want int) {
	t.Helper()
	waitUntil(t, 30*time.Second, "every node registered", func() error {
		l, err := sc.ListNodes(context.Background(), &pb.ListNodesRequest{})
		if err != nil || len(l.Nodes) != want {
			return fmt.Errorf("nodes %v, %v", l, err)
		}
		return nil
	})
}

// partition drops every packet in and out of the node's eth0 with an nftables table in
// its namespace, and returns the function that removes it (also run when the test ends).
func (c *netCluster) partition(t *testing.T, id string) (heal func()) {
	t.Helper()
	ns, table := c.netns[id], "aenv_it_partition"
	nft := func(script string) error {
		return runInNetns(ns, func() error {
			cmd := exec.Command("nft", "-f", "-")
			cmd.Stdin = strings.NewReader(script)
			if out, err := cmd.CombinedOutput(); err != nil {
				return fmt.Errorf("nft in %s: %v: %s", ns, err, out)
			}
			return nil
		})
	}
	if err := nft(fmt.Sprintf(`table inet %s {
  chain in { type filter hook input priority -300; policy accept; iifname "eth0" drop; }
  chain out { type filter hook output priority -300; policy accept; oifname "eth0" drop; }
}`, table)); err != nil {
		t.Fatal(err)
	}
	var once sync.Once
	heal = func() {
		once.Do(func() {
			if err := nft(fmt.Sprintf("delete table inet %s", table)); err != nil {
				t.Errorf("heal the partition: %v", err)
			}
		})
	}
	t.Cleanup(heal)
	return heal
}

// sameNetns reports whether process pid runs in the named namespace.
func sameNetns(t *testing.T, pid int, ns string) bool {
	t.Helper()
	var a, b syscall.Stat_t
	if err := syscall.Stat(fmt.Sprintf("/proc/%d/ns/net", pid), &a); err != nil {
		t.Fatal(err)
	}
	if err := syscall.Stat("/run/netns/"+ns, &b); err != nil {
		t.Fatal(err)
	}
	return a.Dev == b.Dev && a.Ino == b.Ino
}

// A fork through the gateway whose source's node cannot hold every child fans out: the
// children that fit stay on the source's node, the rest are created on the others from a
// snapshot the source's node published to the shared repository; every child has the
// source's files. The gateway deletes that snapshot once the children exist: the children
// keep working after every node has synced the delete, and once they are gone no node
// lists it. A fork that fits stays on the source's node.
func TestForkFanOut(t *testing.T) {
	repo, err := os.MkdirTemp("", "aenv-it-forkfan-repo-")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(repo) })
	// Three sandboxes a node: the source and two children fit on its node.
	c := startNetCluster(t, 3, "AENV_CLUSTER_CPU_COUNT=64", "AENV_CLUSTER_MEMORY_MB=65536", "AENV_SANDBOX_MAX_SANDBOXES=3",
		"AENV_REPOSITORY_POSIX_FS_PATH="+repo, "AENV_SNAPSHOT_SYNC_INTERVAL=1s", "AENV_SNAPSHOT_LAZY_LAYERS=true")
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	gw := c.client(t)
	var kill []string
	t.Cleanup(func() {
		for _, id := range kill {
			_ = gw.Kill(context.Background(), id)
		}
	})
	src, err := gw.Create(ctx, bench.CreateRequest{TemplateID: "base-minimal", Timeout: 600, Secure: true})
	if err != nil {
		t.Fatal(err)
	}
	kill = append(kill, src.ID)
	a := c.nodeOf(ctx, t, src.ID)
	mark := writeMark(ctx, t, gw, src)

	fork := func(count int) ([]bench.Sandbox, map[string]int, time.Duration) {
		t.Helper()
		start := time.Now()
		kids, err := gw.Fork(ctx, src.ID, count, 300)
		took := time.Since(start)
		if err != nil {
			t.Fatalf("fork %d through the gateway: %v", count, err)
		}
		var out []bench.Sandbox
		on := map[string]int{}
		for i, k := range kids {
			if k.Sandbox == nil {
				t.Fatalf("fork child %d failed: %+v", i, k.Error)
			}
			kill = append(kill, k.Sandbox.ID)
			out = append(out, *k.Sandbox)
			on[c.nodeOf(ctx, t, k.Sandbox.ID)]++
		}
		return out, on, took
	}
	kids, on, fanned := fork(4)
	if on[a] != 2 || len(on) < 2 {
		t.Fatalf("4 children of a sandbox on %s (room for 2 there): placed %v, want 2 on %s and the rest elsewhere", a, on, a)
	}
	snapshotsOf := func(base string) string {
		req, _ := http.NewRequestWithContext(ctx, http.MethodGet, base+"/snapshots?sandboxID="+src.ID, nil)
		req.Header.Set("X-API-Key", c.key)
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		defer resp.Body.Close()
		body, _ := io.ReadAll(resp.Body)
		if resp.StatusCode != http.StatusOK {
			t.Fatalf("GET %s/snapshots: %d %s", base, resp.StatusCode, body)
		}
		return strings.TrimSpace(string(body))
	}
	if got := snapshotsOf(c.nodes[a].url()); got != "[]" {
		t.Fatalf("the fork's snapshot is still on the source's node %s: %s", a, got)
	}
	// The other nodes sync every second: they learn of the delete and keep the entry
	// their children use.
	time.Sleep(2500 * time.Millisecond)
	for _, k := range kids {
		if k.Token == "" {
			t.Fatalf("child %s of a secure sandbox has no envd token", k.ID)
		}
		checkMark(ctx, t, gw, k, mark)
	}
	for _, k := range kids {
		if err := gw.Kill(ctx, k.ID); err != nil {
			t.Fatal(err)
		}
	}
	waitUntil(t, 20*time.Second, "no node lists the fork's snapshot once its children are gone", func() error {
		if got := snapshotsOf(c.gateway); got != "[]" {
			return fmt.Errorf("GET /snapshots?sandboxID=%s through the gateway: %s", src.ID, got)
		}
		return nil
	})
	// Room for both on the source's node again (the kills are seen at the next heartbeat).
	waitUntil(t, 20*time.Second, "the kills are reported", func() error {
		l, err := c.sched.ListNodes(ctx, &pb.ListNodesRequest{})
		if err != nil {
			return err
		}
		for _, st := range l.Nodes {
			if st.Node.Id == a && (st.Sandboxes != 1 || st.Reserved.GetSandboxes() != 0) {
				return fmt.Errorf("%s reports %d sandboxes, %d reserved", a, st.Sandboxes, st.Reserved.GetSandboxes())
			}
		}
		return nil
	})
	kids, onLocal, local := fork(2)
	if onLocal[a] != 2 {
		t.Fatalf("2 children of a sandbox on %s with room for them: placed %v, want both there", a, onLocal)
	}
	checkMark(ctx, t, gw, kids[1], mark)
	t.Logf("fork through the gateway: 4 children fanned out over %d nodes %v (2 local) in %v; 2 children on the source's node in %v",
		len(on), on, fanned.Round(time.Millisecond), local.Round(time.Millisecond))
}
