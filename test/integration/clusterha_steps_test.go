package integration

import (
	"context"
	"fmt"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"google.golang.org/grpc/codes"

	"github.com/aenv-dev/aenv/internal/bench"
	pb "github.com/aenv-dev/aenv/internal/cluster/scheduler/gen/schedulerv1"
	"github.com/aenv-dev/aenv/internal/repository"
	"github.com/aenv-dev/aenv/internal/repository/posixfs"
)

// p2pCounts are the byte and chunk counters of one P2P read.
type p2pCounts struct{ served, peer, repo, fallback, bad, verifyFailures int64 }

// p2p: a snapshot published on the first node (which holds its layers whole) is read
// lazily by a sandbox on the second from the first, over the bridge, not from the
// repository; three chunks corrupted in the first node's copy are detected on the third,
// read from the repository instead, and the third's sandbox reads the right bytes.
func (c *haCluster) p2p(ctx context.Context, t *testing.T, sbs *sandboxSet) {
	a, b, cn := c.nodes[c.ids[0]], c.nodes[c.ids[1]], c.nodes[c.ids[2]]
	ca := a.client()
	src := a.create(ctx, ca)
	sbs.add(src)
	run(ctx, t, ca, src, "head -c 67108864 /dev/urandom > /home/user/big")
	want := run(ctx, t, ca, src, "sha256sum < /home/user/big")
	snap := takeSnapshot(ctx, t, a, src.ID, "")
	for _, n := range []*node{b, cn} {
		if !waitFor(3*time.Minute, func() bool { return n.listsSnapshot(ctx, t, snap) }) {
			t.Fatalf("a node never listed snapshot %s", snap)
		}
	}
	pr, err := posixfs.Open(c.repo, posixfs.Options{})
	if err != nil {
		t.Fatal(err)
	}
	rec, err := pr.GetRecord(ctx, repository.KindSnapshot, snap)
	if err != nil {
		t.Fatal(err)
	}
	top := rec.Layers[len(rec.Layers)-1] // the snapshot's own layer, holding the big file
	// A's heartbeats report the layer: the scheduler names A, at its own address, as its peer.
	if !waitFor(30*time.Second, func() bool {
		l, err := c.sched.ListPeers(ctx, &pb.ListPeersRequest{Layer: string(top.Digest)})
		return err == nil && len(l.Peers) == 1 && l.Peers[0].Id == c.ids[0]
	}) {
		t.Fatalf("the scheduler never listed node %s as a peer of %s", c.ids[0], top.Digest)
	}

	measure := func(n *node) p2pCounts {
		return p2pCounts{served: a.metric(ctx, t, "aenv_p2p_served_bytes_total"),
			peer: n.metric(ctx, t, "aenv_p2p_fetched_bytes_total"), repo: n.metric(ctx, t, "aenv_repository_fetched_bytes_total"),
			fallback: n.metric(ctx, t, "aenv_p2p_fallback_bytes_total"), bad: n.metric(ctx, t, "aenv_p2p_bad_chunks_total"),
			verifyFailures: n.metric(ctx, t, "aenv_repository_verify_failures_total")}
	}
	readOn := func(n *node) (before, after p2pCounts) {
		t.Helper()
		before = measure(n)
		cl := n.client()
		child, err := cl.Create(ctx, bench.CreateRequest{TemplateID: snap, Timeout: 600, Secure: true})
		if err != nil {
			t.Fatalf("create from the snapshot: %v", err)
		}
		sbs.add(child)
		n.observe()
		if got := run(ctx, t, cl, child, "sha256sum < /home/user/big"); got != want {
			t.Fatalf("the big file reads %s, A wrote %s", got, want)
		}
		return before, measure(n)
	}

	// B reads the snapshot from A.
	before, after := readOn(b)
	served, peer, fromRepo := after.served-before.served, after.peer-before.peer, after.repo-before.repo
	t.Logf("B: %d MiB from A (A served %d MiB), %d MiB from the repository", peer>>20, served>>20, fromRepo>>20)
	if peer < 64<<20 || served < peer || after.bad != before.bad || after.fallback != before.fallback {
		t.Fatalf("B read %d bytes from peers (A served %d, %d bad chunks, %d fallback bytes); want the 64 MiB file from A",
			peer, served, after.bad-before.bad, after.fallback-before.fallback)
	}
	if fromRepo >= peer {
		t.Fatalf("B read %d bytes from the repository and %d from A; want most from A", fromRepo, peer)
	}

	corruptChunks(t, filepath.Join(a.dataDir, "repository-cache", "blobs", "sha256", top.Digest.Hex()), top.Size)

	// C reads the snapshot: the bad chunks are caught and read from the repository; the
	// sandbox sees the right bytes and no read fails.
	before, after = readOn(cn)
	t.Logf("C: %d MiB from A, %d bad chunks, %d MiB read from the repository instead",
		(after.peer-before.peer)>>20, after.bad-before.bad, (after.fallback-before.fallback)>>20)
	if after.bad == before.bad || after.fallback-before.fallback < 1<<20 || after.verifyFailures != before.verifyFailures {
		t.Fatalf("C: %d bad chunks, %d fallback bytes, %d failed reads; want the corrupt chunks detected and read from the repository",
			after.bad-before.bad, after.fallback-before.fallback, after.verifyFailures-before.verifyFailures)
	}
	if after.peer == before.peer {
		t.Fatal("C read nothing from A")
	}
}

// corruptChunks flips 4 KiB in three places over the first size bytes of the file.
func corruptChunks(t *testing.T, path string, size int64) {
	t.Helper()
	f, err := os.OpenFile(path, os.O_RDWR, 0)
	if err != nil {
		t.Fatalf("A's copy of the layer: %v", err)
	}
	defer f.Close()
	for _, at := range []int64{size / 4, size / 2, 3 * size / 4} {
		buf := make([]byte, 4096)
		if _, err := f.ReadAt(buf, at); err != nil {
			t.Fatal(err)
		}
		for i := range buf {
			buf[i] ^= 0xff
		}
		if _, err := f.WriteAt(buf, at); err != nil {
			t.Fatal(err)
		}
	}
}

// sandboxOn is a sandbox of sbs bound to node id (other than except), or fails the test.
func (c *haCluster) sandboxOn(ctx context.Context, t *testing.T, sbs *sandboxSet, id, except string) bench.Sandbox {
	t.Helper()
	for _, sb := range sbs.list() {
		if sb.ID != except && c.nodeOf(ctx, t, sb.ID) == id {
			return sb
		}
	}
	t.Fatalf("no sandbox on node %s", id)
	return bench.Sandbox{}
}

// partitionNode cuts the third node off with nftables: it goes stale, its sandbox answers
// 503 and creates go to the others; once the rule is gone it rejoins, its sandbox answers
// again and creates come back to it.
func (c *haCluster) partitionNode(ctx context.Context, t *testing.T, gw *bench.Client, sbs *sandboxSet) {
	victim := c.ids[2]
	sb := c.sandboxOn(ctx, t, sbs, victim, "")
	cut := time.Now()
	heal := c.partition(t, victim)
	waitNodeState(ctx, t, c.sched, victim, pb.NodeState_NODE_STATE_STALE)
	stale := time.Since(cut)
	if code, body := c.gwStatus(ctx, t, sb.ID); code != http.StatusServiceUnavailable {
		t.Fatalf("GET a sandbox of the partitioned node: %d %s, want 503", code, body)
	}
	for range 3 {
		if n := c.nodeOf(ctx, t, c.createVia(ctx, t, gw, sbs, false).ID); n == victim {
			t.Fatalf("a create went to the partitioned node %s", victim)
		}
	}

	healed := time.Now()
	heal()
	waitUntil(t, 90*time.Second, "the healed node is ready again", func() error {
		l, err := c.sched.ListNodes(ctx, &pb.ListNodesRequest{})
		if err != nil {
			return err
		}
		for _, st := range l.Nodes {
			if st.Node.Id == victim && st.State != pb.NodeState_NODE_STATE_READY {
				return fmt.Errorf("%s is %v", victim, st.State)
			}
		}
		return nil
	})
	rejoined := time.Since(healed)
	waitUntil(t, 30*time.Second, "the sandbox of the healed node answers through the gateway", func() error {
		res, err := gw.Run(ctx, sb, "echo back")
		if err != nil || strings.TrimSpace(res.Stdout) != "back" {
			return fmt.Errorf("%+v, %v", res, err)
		}
		return nil
	})
	// The healed node is now the least loaded: placements come back to it.
	back := false
	for range 6 {
		if c.nodeOf(ctx, t, c.createVia(ctx, t, gw, sbs, false).ID) == victim {
			back = true
			break
		}
	}
	if !back {
		t.Fatalf("no create went to the healed node %s", victim)
	}
	t.Logf("partition: stale after %v, ready again %v after the rule was removed", stale.Round(time.Millisecond), rejoined.Round(time.Millisecond))
}

// killNode kills a node with SIGKILL after one of its sandboxes was paused to disk: its
// running sandbox is reported lost through the gateway, creates go elsewhere, and the
// paused one resumes on another node through the gateway (same id, token and files). The
// node, restarted, forgets the sandbox another node took over (and cannot resume it), and
// serves the sandbox that survived its death again.
func (c *haCluster) killNode(ctx context.Context, t *testing.T, gw *bench.Client, sbs *sandboxSet) {
	sb := c.createVia(ctx, t, gw, sbs, true)
	v := c.nodeOf(ctx, t, sb.ID)
	running := c.sandboxOn(ctx, t, sbs, v, sb.ID)
	mark := writeMark(ctx, t, gw, sb)
	start := time.Now()
	if err := gw.PauseToDisk(ctx, sb.ID); err != nil {
		t.Fatal(err)
	}
	pausedIn := time.Since(start)

	c.nodes[v].kill9()
	killed := time.Now()
	waitUntil(t, 20*time.Second, "the killed node's sandbox is reported lost", func() error {
		if code, body := c.gwStatus(ctx, t, running.ID); code != http.StatusServiceUnavailable || !strings.Contains(body, "lost") {
			return fmt.Errorf("GET /sandboxes/%s through the gateway: %d %s; want 503 saying it is lost", running.ID, code, body)
		}
		return nil
	})
	lost := time.Since(killed)
	if _, err := gw.Run(ctx, running, "true"); err == nil {
		t.Fatalf("a command in %s on the killed node %s succeeded", running.ID, v)
	}
	for range 3 {
		if n := c.nodeOf(ctx, t, c.createVia(ctx, t, gw, sbs, false).ID); n == v {
			t.Fatalf("a create went to the killed node %s", v)
		}
	}
	// The list covers the live nodes and still works; an unknown sandbox is a 404.
	if code, body, _ := c.get(ctx, t, "/v2/sandboxes"); code != http.StatusOK {
		t.Fatalf("list with a node gone: %d %s", code, body)
	}
	waitLookup(ctx, t, c.sched, "no-such-sandbox", codes.NotFound, "")
	if code, body := c.gwStatus(ctx, t, "no-such-sandbox"); code != http.StatusNotFound {
		t.Fatalf("unknown sandbox through the gateway: %d %s, want 404", code, body)
	}
	start = time.Now()
	res, err := gw.Connect(ctx, sb.ID, 120)
	if err != nil {
		t.Fatalf("resume through the gateway with node %s gone: %v", v, err)
	}
	resumedIn := time.Since(start)
	if res.ID != sb.ID {
		t.Fatalf("resumed as %s, want the same id %s", res.ID, sb.ID)
	}
	to := c.nodeOf(ctx, t, sb.ID)
	if to == v {
		t.Fatalf("resumed on the killed node %s", v)
	}
	if res.Token == "" {
		res.Token = sb.Token
	}
	if res.Token != sb.Token {
		t.Fatalf("envd token changed across the move")
	}
	checkMark(ctx, t, gw, res, mark)
	t.Logf("kill -9 of %s: its sandbox reported lost after %v; pause to disk before the kill %v, resume on %s through the gateway %v",
		v, lost.Round(time.Millisecond), pausedIn.Round(time.Millisecond), to, resumedIn.Round(time.Millisecond))

	// The node comes back: its record of the paused sandbox is obsolete and goes; the
	// scheduler keeps routing to the node that resumed it; the sandbox that kept running
	// through the node's death is adopted and answers through the gateway again.
	n := c.nodes[v]
	n.start()
	waitUntil(t, 30*time.Second, "the restarted node forgets the sandbox resumed elsewhere", func() error {
		if code, _ := n.status(ctx, t, "/sandboxes/"+sb.ID); code != http.StatusNotFound {
			return fmt.Errorf("restarted node %s still holds %s (HTTP %d)", v, sb.ID, code)
		}
		return nil
	})
	if got := c.nodeOf(ctx, t, sb.ID); got != to {
		t.Fatalf("after %s came back the sandbox is bound to %s, want %s", v, got, to)
	}
	checkMark(ctx, t, gw, res, mark)
	if code, body := n.post(ctx, t, "/sandboxes/"+sb.ID+"/connect", `{"timeout":60}`, true); code/100 == 2 {
		t.Fatalf("node %s resumed a sandbox node %s runs: %d %s", v, to, code, body)
	}
	waitUntil(t, 30*time.Second, "the sandbox that survived the kill answers through the gateway", func() error {
		res, err := gw.Run(ctx, running, "echo survived")
		if err != nil || strings.TrimSpace(res.Stdout) != "survived" {
			return fmt.Errorf("%+v, %v", res, err)
		}
		return nil
	})
}
