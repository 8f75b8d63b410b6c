package integration

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/aenv-dev/aenv/internal/bench"
	pb "github.com/aenv-dev/aenv/internal/cluster/scheduler/gen/schedulerv1"
	"github.com/aenv-dev/aenv/internal/repository"
	"github.com/aenv-dev/aenv/internal/repository/posixfs"
)

// TestP2PLayers: three nodes and a scheduler share a posix_fs repository with
// peer-to-peer distribution on. A snapshot published on A (A holds its layers whole) is
// read lazily by B and C from A, not from the repository; a chunk corrupted in A's copy
// is detected on C, read from the repository instead, and C's sandbox reads the right
// bytes.
func TestP2PLayers(t *testing.T) {
	bins := needNode(t)
	sd, sc := startScheduler(t, bins)
	repo, err := os.MkdirTemp("", "aenv-it-p2p-repo-")
	if err != nil {
		t.Fatal(err)
	}
	// Registered before the nodes, so it runs after they are gone.
	t.Cleanup(func() { os.RemoveAll(repo) })
	ctx, cancel := context.WithTimeout(context.Background(), 8*time.Minute)
	defer cancel()
	key, token := "e2b_"+randHex(20), randHex(16)
	var nodes []*node
	for _, id := range []string{"a", "b", "c"} {
		nodes = append(nodes, clusterNode(t, sd.addr, "it-p2p-"+id, key,
			"AENV_REPOSITORY_POSIX_FS_PATH="+repo, "AENV_SNAPSHOT_SYNC_INTERVAL=1s", "AENV_SANDBOX_SHUTDOWN_ACTION=stop",
			"AENV_SNAPSHOT_LAZY_LAYERS=true", "AENV_CLUSTER_P2P_ENABLED=true", "AENV_CLUSTER_P2P_TOKEN="+token,
			fmt.Sprintf("AENV_CLUSTER_P2P_LISTEN=127.0.0.1:%d", freePort(t)), "AENV_CLUSTER_P2P_TIMEOUT=30s"))
	}
	a, b, c := nodes[0], nodes[1], nodes[2]
	ca, cb, cc := a.client(), b.client(), c.client()

	src := a.create(ctx, ca)
	run(ctx, t, ca, src, "head -c 67108864 /dev/urandom > /home/user/big")
	want := run(ctx, t, ca, src, "sha256sum < /home/user/big")
	snap := takeSnapshot(ctx, t, a, src.ID, "")
	for _, n := range []*node{b, c} {
		if !waitFor(3*time.Minute, func() bool { return n.listsSnapshot(ctx, t, snap) }) {
			t.Fatalf("a node never listed snapshot %s", snap)
		}
	}
	pr, err := posixfs.Open(repo, posixfs.Options{})
	if err != nil {
		t.Fatal(err)
	}
	rec, err := pr.GetRecord(ctx, repository.KindSnapshot, snap)
	if err != nil {
		t.Fatal(err)
	}
	top := rec.Layers[len(rec.Layers)-1] // the snapshot's own layer, holding the big file
	// A's heartbeats report the layer: the scheduler names A as its peer.
	if !waitFor(30*time.Second, func() bool {
		l, err := sc.ListPeers(ctx, &pb.ListPeersRequest{Layer: string(top.Digest)})
		return err == nil && len(l.Peers) == 1 && l.Peers[0].Id == "it-p2p-a"
	}) {
		t.Fatalf("the scheduler never listed node A as a peer of %s", top.Digest)
	}

	type counts struct{ served, peer, repo, fallback, bad, verifyFailures int64 }
	measure := func(n *node) counts {
		return counts{served: a.metric(ctx, t, "aenv_p2p_served_bytes_total"),
			peer: n.metric(ctx, t, "aenv_p2p_fetched_bytes_total"), repo: n.metric(ctx, t, "aenv_repository_fetched_bytes_total"),
			fallback: n.metric(ctx, t, "aenv_p2p_fallback_bytes_total"), bad: n.metric(ctx, t, "aenv_p2p_bad_chunks_total"),
			verifyFailures: n.metric(ctx, t, "aenv_repository_verify_failures_total")}
	}
	readOn := func(n *node, cl *bench.Client) (before, after counts) {
		t.Helper()
		before = measure(n)
		child, err := cl.Create(ctx, bench.CreateRequest{TemplateID: snap, Timeout: 300, Secure: true})
		if err != nil {
			t.Fatalf("create from the snapshot: %v", err)
		}
		n.observe()
		if got := run(ctx, t, cl, child, "sha256sum < /home/user/big"); got != want {
			t.Fatalf("the big file reads %s, A wrote %s", got, want)
		}
		return before, measure(n)
	}

	// B reads the snapshot from A.
	before, after := readOn(b, cb)
	served, peer, fromRepo := after.served-before.served, after.peer-before.peer, after.repo-before.repo
	t.Logf("B: %d MiB from A (A served %d MiB), %d MiB from the repository", peer>>20, served>>20, fromRepo>>20)
	if peer < 64<<20 || served < peer || after.bad != before.bad || after.fallback != before.fallback {
		t.Fatalf("B read %d bytes from peers (A served %d, %d bad chunks, %d fallback bytes); want the 64 MiB file from A",
			peer, served, after.bad-before.bad, after.fallback-before.fallback)
	}
	if fromRepo >= peer {
		t.Fatalf("B read %d bytes from the repository and %d from A; want most from A", fromRepo, peer)
	}

	// A chunk of A's copy of the layer goes bad (in three places over its data).
	blob := filepath.Join(a.dataDir, "repository-cache", "blobs", "sha256", top.Digest.Hex())
	f, err := os.OpenFile(blob, os.O_RDWR, 0)
	if err != nil {
		t.Fatalf("A's copy of the layer: %v", err)
	}
	for _, at := range []int64{top.Size / 4, top.Size / 2, 3 * top.Size / 4} {
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
	f.Close()

	// C reads the snapshot: the bad chunks are caught and read from the repository; the
	// sandbox sees the right bytes and no read fails.
	before, after = readOn(c, cc)
	t.Logf("C: %d MiB from A, %d bad chunks, %d MiB read from the repository instead",
		(after.peer-before.peer)>>20, after.bad-before.bad, (after.fallback-before.fallback)>>20)
	if after.bad == before.bad || after.fallback-before.fallback < 1<<20 || after.verifyFailures != before.verifyFailures {
		t.Fatalf("C: %d bad chunks, %d fallback bytes, %d failed reads; want the corrupt chunks detected and read from the repository",
			after.bad-before.bad, after.fallback-before.fallback, after.verifyFailures-before.verifyFailures)
	}
	if after.peer == before.peer {
		t.Fatal("C read nothing from A")
	}

	killAll(ctx, t, ca)
	killAll(ctx, t, cb)
	killAll(ctx, t, cc)
	for _, n := range nodes {
		n.stop()
		requireNoLeftovers(t, n, nil)
	}
}
