package microvm

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/aenv-dev/aenv/internal/catalog"
	"github.com/aenv-dev/aenv/internal/repository"
	"github.com/aenv-dev/aenv/internal/repository/layers"
	"github.com/aenv-dev/aenv/internal/repository/posixfs"
	"github.com/aenv-dev/aenv/internal/sandbox"
	"github.com/aenv-dev/aenv/internal/snapshot"
	"github.com/aenv-dev/aenv/internal/storage/cache"
)

// repoNode is one node of a two-node test: a backend, a catalog and a publisher on a
// shared repository, wired as package node wires them (the layer resolver reads and
// fetches by digest, verified against the block hash lists the publisher learns).
type repoNode struct {
	b    *Backend
	cat  *catalog.Catalog
	pub  *snapshot.Publisher
	repo repository.Repository
}

func newRepoNode(t *testing.T, repo repository.Repository, name string, opts ...func(*Config)) *repoNode {
	t.Helper()
	dir := t.TempDir()
	cat, err := catalog.Open(filepath.Join(dir, "catalog.db"))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { cat.Close() })
	pub, err := snapshot.New(repo, cat.Templates(), snapshot.Options{NodeID: name, StateDir: filepath.Join(dir, "snapshot"),
		LazyLayers: true, MaxAttempts: 1})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { pub.Close() })
	res := &layers.Resolver{Repo: repo, Remote: repo, Hashes: pub.HashIndex()}
	b := newTestBackend(t, append([]func(*Config){func(c *Config) { c.LayerResolver, c.BlobFetcher = res, res }}, opts...)...)
	return &repoNode{b: b, cat: cat, pub: pub, repo: repo}
}

// otherNetwork is a second node's network: its own bridge, prefix and subnet.
func otherNetwork(c *Config) {
	n := os.Getpid()
	c.Network.Bridge = fmt.Sprintf("mvt%db", n%100000)
	c.Network.Prefix = fmt.Sprintf("mv%db", n%100000)
	c.Network.Subnet = fmt.Sprintf("10.98.%d.0/24", n%250+1)
}

// publish registers capture c as snapshot id in n's catalog and publishes it, as the
// orchestrator does; it returns how long the publication took.
func (n *repoNode) publish(t *testing.T, id string, c sandbox.Captured) time.Duration {
	t.Helper()
	ctx := context.Background()
	raw, err := c.Encode()
	if err != nil {
		t.Fatal(err)
	}
	mc := c.(*capture)
	tpl := catalog.Template{ID: id, Kind: catalog.KindSnapshot, Backend: "microvm", Resources: mc.Resources,
		Artifact: raw, CreatedAt: time.Now()}
	if err := n.cat.Templates().Put(tpl); err != nil {
		t.Fatal(err)
	}
	t0 := time.Now()
	h, err := n.pub.PublishTemplate(ctx, tpl, "")
	if err != nil {
		t.Fatal(err)
	}
	if err := h.Wait(ctx); err != nil {
		t.Fatalf("publish %s: %v", id, err)
	}
	return time.Since(t0)
}

// synced returns the capture of snapshot id as n's catalog has it after a sync.
func (n *repoNode) synced(t *testing.T, id string) *capture {
	t.Helper()
	tpl, err := n.cat.Templates().Get(id)
	if err != nil {
		t.Fatalf("%s not synced: %v", id, err)
	}
	c, err := n.b.DecodeCaptured(tpl.Artifact)
	if err != nil {
		t.Fatalf("decode synced %s: %v", id, err)
	}
	return c.(*capture)
}

// TestMemoryImageOnAnotherNode: a snapshot and a pause taken on node A are published to a
// shared posix_fs repository with their memory images; node B syncs the records, and a
// launch from the snapshot and a resume of the pause continue A's processes on B. A
// corrupted chunk of the RAM blob fails B's launch with a verification error and leaves
// nothing behind.
func TestMemoryImageOnAnotherNode(t *testing.T) {
	ctx := context.Background()
	repo, err := posixfs.Open(filepath.Join(t.TempDir(), "repo"), posixfs.Options{})
	if err != nil {
		t.Fatal(err)
	}
	a := newRepoNode(t, repo, "node-a")
	b := newRepoNode(t, repo, "node-b", otherNetwork)

	// 256 MiB: the guest size the publication figures are reported for.
	const memMB = 256
	src := launch(t, a.b, "sbx-xsrc", sandbox.Resources{CPUCount: 1, MemoryMB: memMB, DiskSizeMB: templateMB})
	pid := strings.TrimSpace(mustSh(t, src, counterScript))
	mustSh(t, src, `echo from-a > /root/mark`)
	time.Sleep(time.Second)
	// The counter runs on: the snapshot holds at least the value read before it.
	_, _, atSnap := counterState(t, src)
	snap, err := src.Snapshot(ctx)
	if err != nil {
		t.Fatal(err)
	}
	sc := snap.(*capture)
	if !within(sc.Memory.RAM.Path, a.b.cfg.capturesDir()) {
		t.Fatalf("snapshot RAM file %s is not persisted with the capture", sc.Memory.RAM.Path)
	}
	pubTime := a.publish(t, "snap-x", snap)
	rec, err := repo.GetRecord(ctx, repository.KindSnapshot, "snap-x")
	if err != nil {
		t.Fatal(err)
	}
	var total int64
	var ram repository.Layer
	roles := map[string]int{}
	for _, l := range rec.Layers {
		total += l.Size
		roles[l.Role]++
		if l.Role == roleMemory {
			ram = l
		}
	}
	if roles[roleMemory] != 1 || roles[roleVMState] != 1 || ram.BlockHashes == "" {
		t.Fatalf("record layers %+v: want one memory and one vmstate blob, with block hashes", rec.Layers)
	}
	blob := filepath.Join(repo.Root(), "blobs", "sha256", ram.Digest.Hex())
	var st syscall.Stat_t
	if err := syscall.Stat(blob, &st); err != nil {
		t.Fatal(err)
	}
	t.Logf("publish of a %d MiB guest's snapshot: %v, %d blobs, %.1f MiB (RAM blob %.1f MiB, %.1f MiB allocated in the repository)",
		memMB, pubTime.Round(time.Millisecond), len(rec.Layers), float64(total)/(1<<20), float64(ram.Size)/(1<<20),
		float64(st.Blocks*512)/(1<<20))

	mustSh(t, src, `echo after-snap > /root/mark`)
	paused, err := src.Pause(ctx, sandbox.PauseOptions{KeepMemory: true})
	if err != nil {
		t.Fatal(err)
	}
	a.publish(t, "pause-x", paused.(*capture))

	if _, err := b.pub.Sync(ctx); err != nil {
		t.Fatal(err)
	}
	bc := b.synced(t, "snap-x")
	if bc.Memory.RAM.Path != "" || bc.Memory.RAM.Digest != string(ram.Digest) {
		t.Fatalf("synced RAM blob %+v: want digest %s and no path", bc.Memory.RAM, ram.Digest)
	}

	// A corrupted chunk: the launch fails on it, nothing is left on B.
	restore := flipByte(t, blob, ram.Size/2)
	_, err = b.b.Launch(ctx, sandbox.LaunchPlan{Kind: sandbox.LaunchFromSnapshot, SandboxID: "sbx-xbad", Snapshot: bc})
	if !errors.Is(err, cache.ErrVerify) {
		t.Fatalf("launch from a corrupted RAM blob = %v, want a verification error", err)
	}
	t.Logf("corrupted chunk: %v", err)
	if ents, _ := os.ReadDir(b.b.cfg.sandboxesDir()); len(ents) > 0 || len(qemusUnder(b.b.cfg.DataDir)) > 0 {
		t.Fatalf("a failed launch left %d sandbox dirs, QEMUs %v", len(ents), qemusUnder(b.b.cfg.DataDir))
	}
	if ents, _ := os.ReadDir(b.b.cfg.fetchedDir()); len(ents) > 0 {
		t.Fatalf("a failed fetch left %d files in %s", len(ents), b.b.cfg.fetchedDir())
	}
	restore()

	// The snapshot on B: A's counter process continues, A's disk is there.
	for k, id := range []string{"sbx-xb1", "sbx-xb2"} {
		t0 := time.Now()
		inst, err := b.b.Launch(ctx, sandbox.LaunchPlan{Kind: sandbox.LaunchFromSnapshot, SandboxID: id, Snapshot: bc})
		if err != nil {
			t.Fatal(err)
		}
		i := inst.(*Instance)
		waitEnvd(t, i)
		gotPID, running, v := counterState(t, i)
		t.Logf("create from A's snapshot on B (%s RAM file) → first command: %v",
			map[int]string{0: "fetching the", 1: "the fetched"}[k], time.Since(t0).Round(time.Millisecond))
		if gotPID != pid || !running || v < atSnap {
			t.Fatalf("%s: counter pid %s (want %s) running %v value %d (snapshot had %d)", id, gotPID, pid, running, v, atSnap)
		}
		if got := strings.TrimSpace(mustSh(t, i, `cat /root/mark`)); got != "from-a" {
			t.Fatalf("%s: /root/mark = %q", id, got)
		}
	}

	// The pause on B: resumes with its processes and the disk as it was at the pause.
	pc := b.synced(t, "pause-x")
	t0 := time.Now()
	inst, err := b.b.Launch(ctx, sandbox.LaunchPlan{Kind: sandbox.LaunchResume, SandboxID: "sbx-xsrc", Paused: pc})
	if err != nil {
		t.Fatal(err)
	}
	i := inst.(*Instance)
	waitEnvd(t, i)
	gotPID, running, v := counterState(t, i)
	t.Logf("resume of A's pause on B → first command: %v", time.Since(t0).Round(time.Millisecond))
	if gotPID != pid || !running || v < atSnap {
		t.Fatalf("resumed: counter pid %s (want %s) running %v value %d", gotPID, pid, running, v)
	}
	if got := strings.TrimSpace(mustSh(t, i, `cat /root/mark`)); got != "after-snap" {
		t.Fatalf("resumed: /root/mark = %q", got)
	}
}

// flipByte inverts the byte at off of file path and returns a function that puts it back.
func flipByte(t *testing.T, path string, off int64) func() {
	t.Helper()
	f, err := os.OpenFile(path, os.O_RDWR, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	var b [1]byte
	if _, err := f.ReadAt(b[:], off); err != nil {
		t.Fatal(err)
	}
	orig := b[0]
	b[0] ^= 0xff
	if _, err := f.WriteAt(b[:], off); err != nil {
		t.Fatal(err)
	}
	return func() {
		f, err := os.OpenFile(path, os.O_RDWR, 0)
		if err != nil {
			t.Fatal(err)
		}
		defer f.Close()
		if _, err := f.WriteAt([]byte{orig}, off); err != nil {
			t.Fatal(err)
		}
	}
}
