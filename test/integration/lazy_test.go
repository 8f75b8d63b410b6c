package integration

import (
	"bufio"
	"bytes"
	"context"
	"fmt"
	"net/http"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/aenv-dev/aenv/internal/bench"
	"github.com/aenv-dev/aenv/internal/repository"
	"github.com/aenv-dev/aenv/internal/repository/posixfs"
)

// lazyPair is two nodes sharing one posix_fs repository directory; each reads the
// other's templates and snapshots lazily (snapshot.lazy_layers, set whatever the
// environment says).
type lazyPair struct {
	repo string
	a, b *node
	nets []nodeNet
}

// startPair starts two nodes with names of their own on a fresh shared repository.
func startPair(t testing.TB, env ...string) *lazyPair {
	t.Helper()
	repo, err := os.MkdirTemp("", "aenv-it-repo-")
	if err != nil {
		t.Fatal(err)
	}
	na := uniqueNet(t)
	nb := uniqueNet(t)
	p := &lazyPair{repo: repo, nets: []nodeNet{na, nb}}
	// Registered first, so it runs last: after each node was killed and swept.
	t.Cleanup(func() {
		for _, n := range p.nets {
			n.teardown(t)
		}
		os.RemoveAll(repo)
	})
	common := append([]string{"AENV_REPOSITORY_POSIX_FS_PATH=" + repo, "AENV_SNAPSHOT_SYNC_INTERVAL=1s",
		"AENV_SANDBOX_SHUTDOWN_ACTION=stop", "AENV_SNAPSHOT_LAZY_LAYERS=true"}, env...)
	p.a = na.newNode(t, common...)
	p.b = nb.newNode(t, common...)
	p.a.start()
	p.b.start()
	return p
}

// imageBytes is the total size of the layers the repository's record of id names.
func imageBytes(ctx context.Context, t testing.TB, repoDir, id string) int64 {
	t.Helper()
	r, err := posixfs.Open(repoDir, posixfs.Options{})
	if err != nil {
		t.Fatal(err)
	}
	rec, err := r.GetRecord(ctx, repository.KindSnapshot, id)
	if err != nil {
		t.Fatal(err)
	}
	var n int64
	for _, l := range rec.Layers {
		n += l.Size
	}
	return n
}

// metric reads one unlabelled counter or gauge from the node's /metrics.
func (n *node) metric(ctx context.Context, t testing.TB, name string) int64 {
	t.Helper()
	out, err := n.api(ctx, http.MethodGet, "/metrics", "", http.StatusOK)
	if err != nil {
		t.Fatal(err)
	}
	sc := bufio.NewScanner(bytes.NewReader(out))
	sc.Buffer(make([]byte, 1<<20), 1<<20)
	for sc.Scan() {
		if v, ok := strings.CutPrefix(sc.Text(), name+" "); ok {
			f, err := strconv.ParseFloat(strings.TrimSpace(v), 64)
			if err != nil {
				t.Fatalf("metric %s: %v", name, err)
			}
			return int64(f)
		}
	}
	t.Fatalf("metric %s not on /metrics", name)
	return 0
}

// filesUnder lists the regular files under dir (none when it does not exist).
func filesUnder(dir string) []string {
	var out []string
	_ = filepath.WalkDir(dir, func(p string, d os.DirEntry, err error) error {
		if err == nil && d.Type().IsRegular() {
			out = append(out, p)
		}
		return nil
	})
	return out
}

// TestLazyLayersOnSecondNode: node A makes an image of a few hundred MiB (a snapshot of a
// base sandbox that wrote a big random file); node B, which shares A's repository, creates
// a sandbox from it and reads a small part of the file. B downloads no layer whole (its
// node cache and fetched-layer store stay empty) and fetches a small fraction of the
// image from the repository; the bytes read match what A wrote. B's sandbox on those
// lazily read layers then outlives the deletion of its snapshot on A (B keeps the blobs it
// reads alive in the repository, so A's GC spares them past the grace period), survives
// pause to disk, a restart of B and resume, is snapshotted (the snapshot, whose lowers are digest-only,
// creates a sandbox on A) and forked.
func TestLazyLayersOnSecondNode(t *testing.T) {
	const grace = 30 * time.Second
	p := startPair(t, "AENV_SNAPSHOT_GC_GRACE="+grace.String())
	a, b := p.a, p.b
	ctx, cancel := context.WithTimeout(context.Background(), 8*time.Minute)
	defer cancel()
	ca, cb := a.client(), b.client()

	const bigMiB = 256
	src := a.create(ctx, ca)
	run(ctx, t, ca, src, fmt.Sprintf("head -c %d /dev/urandom > /home/user/big && echo a > /home/user/mark", bigMiB<<20))
	const readHead = "head -c 4194304 /home/user/big | sha256sum"
	want := run(ctx, t, ca, src, readHead)
	const readTail = "tail -c 4194304 /home/user/big | sha256sum"
	wantTail := run(ctx, t, ca, src, readTail)
	snap := takeSnapshot(ctx, t, a, src.ID, "")
	if !waitFor(3*time.Minute, func() bool { return b.listsSnapshot(ctx, t, snap) }) {
		t.Fatalf("node B never listed snapshot %s", snap)
	}
	published := time.Now()
	image := imageBytes(ctx, t, p.repo, snap)
	if image < bigMiB<<20 {
		t.Fatalf("image of %d bytes, want at least the %d MiB written", image, bigMiB)
	}

	before := b.metric(ctx, t, "aenv_repository_fetched_bytes_total")
	start := time.Now()
	child, err := cb.Create(ctx, bench.CreateRequest{TemplateID: snap, Timeout: 600, Secure: true})
	if err != nil {
		t.Fatalf("create from A's snapshot on node B: %v", err)
	}
	b.observe()
	if got := run(ctx, t, cb, child, readHead); got != want {
		t.Fatalf("node B reads %q from the first 4 MiB, node A %q", got, want)
	}
	elapsed := time.Since(start)
	fetched := b.metric(ctx, t, "aenv_repository_fetched_bytes_total") - before
	t.Logf("node B: create + read 4 MiB of a %d MiB image in %s, %.1f MiB fetched from the repository",
		image>>20, elapsed.Round(time.Millisecond), float64(fetched)/(1<<20))
	if fetched <= 0 || fetched*8 > image {
		t.Fatalf("node B fetched %d bytes of a %d-byte image: not lazy", fetched, image)
	}
	if got := filesUnder(filepath.Join(b.dataDir, "repository-cache", "blobs")); len(got) != 0 {
		t.Fatalf("node B downloaded whole blobs: %v", got)
	}
	if got := filesUnder(filepath.Join(b.dataDir, "snapshot", "layers")); len(got) != 0 {
		t.Fatalf("node B fetched layers: %v", got)
	}

	// Deleted on A once its blobs were last put longer ago than the grace period: only
	// B's keep-alive saves them from A's GC. B reads a part it has not read yet, and the
	// resume below opens the blobs again (on posix_fs an open blob stays readable after
	// GC unlinks it; a reopen does not).
	time.Sleep(time.Until(published.Add(grace + 10*time.Second)))
	if _, err := a.api(ctx, http.MethodDelete, "/templates/"+snap, "", http.StatusNoContent); err != nil {
		t.Fatal(err)
	}
	if got := run(ctx, t, cb, child, readTail); got != wantTail {
		t.Fatalf("after the delete on A node B reads %q from the last 4 MiB, node A read %q", got, wantTail)
	}

	// Pause to disk and resume: the capture's lowers are digest-only.
	run(ctx, t, cb, child, "echo b > /home/user/mark")
	if _, err := b.api(ctx, http.MethodPost, "/sandboxes/"+child.ID+"/pause", `{"memory":false}`, http.StatusNoContent); err != nil {
		t.Fatalf("pause to disk on lazy layers: %v", err)
	}
	// Across a restart of B: the capture (digest-only lowers) and its pins are reloaded.
	b.stop()
	b.start()
	cb = b.client()
	child, err = cb.Connect(ctx, child.ID, 600)
	if err != nil {
		t.Fatalf("resume on lazy layers: %v", err)
	}
	if got := run(ctx, t, cb, child, "cat /home/user/mark; "+readHead+"; "+readTail); got != "b\n"+want+"\n"+wantTail {
		t.Fatalf("after pause to disk and resume node B reads %q", got)
	}

	// A snapshot on B names A's layers by digest: A creates a sandbox from it.
	snapB := takeSnapshot(ctx, t, b, child.ID, "")
	if !waitFor(3*time.Minute, func() bool { return a.listsSnapshot(ctx, t, snapB) }) {
		t.Fatalf("node A never listed snapshot %s taken on node B", snapB)
	}
	back, err := ca.Create(ctx, bench.CreateRequest{TemplateID: snapB, Timeout: 600, Secure: true})
	if err != nil {
		t.Fatalf("create on A from B's snapshot of lazy layers: %v", err)
	}
	a.observe()
	if got := run(ctx, t, ca, back, "cat /home/user/mark; "+readHead); got != "b\n"+want {
		t.Fatalf("node A's sandbox from B's snapshot reads %q", got)
	}

	// Fork on B.
	kids, err := cb.Fork(ctx, child.ID, 2, 600)
	if err != nil {
		t.Fatalf("fork on lazy layers: %v", err)
	}
	b.observe()
	for _, k := range kids {
		if k.Sandbox == nil {
			t.Fatalf("fork child failed: %+v", k.Error)
		}
		if got := run(ctx, t, cb, *k.Sandbox, "cat /home/user/mark"); got != "b" {
			t.Fatalf("fork child reads %q", got)
		}
	}

	killAll(ctx, t, ca)
	killAll(ctx, t, cb)
	a.stop()
	b.stop()
	for i, n := range []*node{a, b} {
		if left := leftovers(t, n, nil); len(left) > 0 {
			t.Errorf("node %c left behind:\n  %s", 'A'+i, strings.Join(left, "\n  "))
		}
		if left := p.nets[i].leftovers(); len(left) > 0 {
			t.Errorf("node %c left behind:\n  %s", 'A'+i, strings.Join(left, "\n  "))
		}
	}
}
