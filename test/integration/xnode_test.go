package integration

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"os"
	"os/exec"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/aenv-dev/aenv/internal/bench"
	pb "github.com/aenv-dev/aenv/internal/cluster/scheduler/gen/schedulerv1"
)

// startSharedCluster is startCluster with nodes sharing one repository (a posix-fs
// directory), which is what lets a sandbox paused on one node resume on another.
func startSharedCluster(t *testing.T, nodes int) *cluster {
	t.Helper()
	bins := needNode(t)
	repo, err := os.MkdirTemp("", "aenv-it-xnode-repo-")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(repo) })
	sd, sc := startScheduler(t, bins)
	c := &cluster{sched: sc, nodes: map[string]*node{}, key: "e2b_" + randHex(20), bins: bins}
	for i := range nodes {
		id := fmt.Sprintf("it-xnode-%d", i)
		c.nodes[id] = clusterNode(t, sd.addr, id, c.key, "AENV_CLUSTER_CPU_COUNT=64", "AENV_CLUSTER_MEMORY_MB=65536",
			"AENV_REPOSITORY_POSIX_FS_PATH="+repo, "AENV_SNAPSHOT_SYNC_INTERVAL=1s", "AENV_SNAPSHOT_LAZY_LAYERS=true",
			"AENV_SANDBOX_SHUTDOWN_ACTION=stop")
	}
	addr := fmt.Sprintf("127.0.0.1:%d", freePort(t))
	c.gateway = "http://" + addr
	startDaemon(t, bins, []string{"AENV_API_KEY=" + c.key}, func() bool {
		resp, err := http.Get(c.gateway + "/health")
		if err != nil {
			return false
		}
		resp.Body.Close()
		return resp.StatusCode == http.StatusNoContent
	}, "gateway", "--listen", addr, "--scheduler", sd.addr)
	deadline := time.Now().Add(30 * time.Second)
	for {
		l, err := sc.ListNodes(context.Background(), &pb.ListNodesRequest{})
		if err == nil && len(l.Nodes) == nodes {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("nodes did not register: %v %v", l, err)
		}
		time.Sleep(100 * time.Millisecond)
	}
	return c
}

// writeMark writes a file with content unique to the sandbox and returns the content.
func writeMark(ctx context.Context, t *testing.T, gw *bench.Client, sb bench.Sandbox) string {
	t.Helper()
	mark := "mark-" + randHex(6)
	if res, err := gw.Run(ctx, sb, "echo "+mark+" > ~/mark && sync"); err != nil || res.ExitCode != 0 {
		t.Fatalf("write a file in %s: %+v, %v", sb.ID, res, err)
	}
	return mark
}

func checkMark(ctx context.Context, t *testing.T, gw *bench.Client, sb bench.Sandbox, mark string) {
	t.Helper()
	res, err := gw.Run(ctx, sb, "cat ~/mark")
	if err != nil || strings.TrimSpace(res.Stdout) != mark {
		t.Fatalf("the file written before the move, in %s: %+v, %v; want %q", sb.ID, res, err, mark)
	}
}

// `aenv nodes drain` stops placements on a node and pauses its sandboxes to disk; they
// resume on the other node through the gateway. `aenv nodes undrain` reopens the node.
func TestDrainNode(t *testing.T) {
	c := startSharedCluster(t, 2)
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	gw := c.client(t)

	sb, err := gw.Create(ctx, bench.CreateRequest{TemplateID: "base-minimal", Timeout: 300, Secure: true})
	if err != nil {
		t.Fatal(err)
	}
	a := c.nodeOf(ctx, t, sb.ID)
	mark := writeMark(ctx, t, gw, sb)
	aenv := func(args ...string) string {
		t.Helper()
		out, err := exec.CommandContext(ctx, c.bins.aenv, append(args, "--url", c.gateway, "--api-key", c.key)...).CombinedOutput()
		if err != nil {
			t.Fatalf("aenv %v: %v\n%s", args, err, out)
		}
		return string(out)
	}
	out := aenv("nodes", "drain", a)
	if !strings.Contains(out, "1 sandboxes paused") {
		t.Fatalf("aenv nodes drain: %s", out)
	}
	if st := nodeStates(t, aenv("nodes", "-o", "json"))[a]; st != "draining" {
		t.Fatalf("aenv nodes shows %s as %q, want draining", a, st)
	}
	for range 3 {
		other, err := gw.Create(ctx, bench.CreateRequest{TemplateID: "base-minimal", Timeout: 60})
		if err != nil {
			t.Fatal(err)
		}
		if n := c.nodeOf(ctx, t, other.ID); n == a {
			t.Fatalf("a create went to draining node %s", a)
		}
	}
	res, err := gw.Connect(ctx, sb.ID, 120)
	if err != nil {
		t.Fatalf("resume a sandbox of the draining node: %v", err)
	}
	if b := c.nodeOf(ctx, t, sb.ID); b == a {
		t.Fatalf("the sandbox resumed on the draining node %s", a)
	}
	if res.Token == "" {
		res.Token = sb.Token
	}
	checkMark(ctx, t, gw, res, mark)
	// The draining node forgets the sandbox it no longer runs.
	deadline := time.Now().Add(20 * time.Second)
	for {
		if code, _ := c.nodes[a].status(ctx, t, "/sandboxes/"+sb.ID); code == http.StatusNotFound {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("draining node %s still lists %s", a, sb.ID)
		}
		time.Sleep(200 * time.Millisecond)
	}

	aenv("nodes", "undrain", a)
	if st := nodeStates(t, aenv("nodes", "-o", "json"))[a]; st != "ready" {
		t.Fatalf("after undrain aenv nodes shows %s as %q, want ready", a, st)
	}

	// Back and forth: drain the sandbox's node, resume it through the gateway on the other,
	// undrain. Each move keeps the files (the figures are for the notes, not assertions).
	var drains, resumes []time.Duration
	for range 4 {
		from := c.nodeOf(ctx, t, sb.ID)
		start := time.Now()
		aenv("nodes", "drain", from)
		drains = append(drains, time.Since(start))
		start = time.Now()
		res, err = gw.Connect(ctx, sb.ID, 120)
		if err != nil {
			t.Fatalf("resume after draining %s: %v", from, err)
		}
		resumes = append(resumes, time.Since(start))
		if to := c.nodeOf(ctx, t, sb.ID); to == from {
			t.Fatalf("resumed on the drained node %s", from)
		}
		if res.Token == "" {
			res.Token = sb.Token
		}
		checkMark(ctx, t, gw, res, mark)
		aenv("nodes", "undrain", from)
	}
	t.Logf("move between nodes, medians of %d: drain (pause to disk + publish, via the CLI) %v, resume on the other node %v",
		len(resumes), medianOf(drains), medianOf(resumes))
}

func medianOf(ds []time.Duration) time.Duration {
	s := slices.Clone(ds)
	slices.Sort(s)
	return s[len(s)/2].Round(time.Millisecond)
}

func nodeStates(t *testing.T, out string) map[string]string {
	t.Helper()
	var nodes []struct {
		NodeID string `json:"nodeID"`
		State  string `json:"state"`
	}
	if err := json.Unmarshal([]byte(out), &nodes); err != nil {
		t.Fatalf("aenv nodes -o json: %v\n%s", err, out)
	}
	m := map[string]string{}
	for _, n := range nodes {
		m[n.NodeID] = n.State
	}
	return m
}

func waitNodeState(ctx context.Context, t *testing.T, c pb.SchedulerClient, id string, want pb.NodeState) {
	t.Helper()
	deadline := time.Now().Add(20 * time.Second)
	for time.Now().Before(deadline) {
		l, err := c.ListNodes(ctx, &pb.ListNodesRequest{})
		if err == nil && slices.ContainsFunc(l.Nodes, func(n *pb.NodeStatus) bool { return n.Node.Id == id && n.State == want }) {
			return
		}
		time.Sleep(100 * time.Millisecond)
	}
	t.Fatalf("node %s never became %v", id, want)
}

// status GETs path on the node and returns the HTTP status and body.
func (n *node) status(ctx context.Context, t *testing.T, path string) (int, []byte) {
	t.Helper()
	return n.post(ctx, t, path, "", false)
}

// post sends body to path on the node (GET when body is empty), with the gateway's
// adopt header when adopt, and returns the HTTP status and body.
func (n *node) post(ctx context.Context, t *testing.T, path, body string, adopt bool) (int, []byte) {
	t.Helper()
	method := http.MethodPost
	if body == "" {
		method = http.MethodGet
	}
	req, err := http.NewRequestWithContext(ctx, method, n.url()+path, strings.NewReader(body))
	if err != nil {
		t.Fatal(err)
	}
	req.Header.Set("X-API-Key", n.key)
	req.Header.Set("Content-Type", "application/json")
	if adopt {
		req.Header.Set("X-Aenv-Adopt", "1")
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	out, _ := io.ReadAll(resp.Body)
	return resp.StatusCode, out
}
