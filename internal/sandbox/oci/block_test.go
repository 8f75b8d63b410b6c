package oci

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/aenv-dev/aenv/internal/sandbox"
	"github.com/aenv-dev/aenv/internal/storage/lsmt"
	"github.com/aenv-dev/aenv/internal/storage/stack"
)

var (
	layeredOnce sync.Once
	layeredRef  sandbox.LayerRef
	layeredErr  error
)

// layeredSizeMB is the test template's ext4 size.
const layeredSizeMB = 256

// testLayered makes the base template into a one-layer overlaybd template once per test
// binary: mkfs.ext4 -d of the template directory, imported as a sealed layer (what
// `aenv pull --convert` produces, in one layer). It lives next to the directory template
// and goes with it in TestMain.
func testLayered(t testing.TB) sandbox.RootFS {
	t.Helper()
	needBlock(t)
	dir := testTemplate(t)
	layeredOnce.Do(func() { layeredRef, layeredErr = importDir(dir, filepath.Join(filepath.Dir(dir), "base.commit")) })
	if layeredErr != nil {
		t.Fatal(layeredErr)
	}
	return sandbox.RootFS{Layers: []sandbox.LayerRef{layeredRef}, VirtualSize: layeredSizeMB << 20}
}

func importDir(src, out string) (sandbox.LayerRef, error) {
	img := out + ".img"
	defer os.Remove(img)
	if b, err := exec.Command("mkfs.ext4", "-q", "-F", "-E", "root_owner=0:0", "-d", src, img, fmt.Sprintf("%dM", layeredSizeMB)).CombinedOutput(); err != nil {
		return sandbox.LayerRef{}, fmt.Errorf("mkfs.ext4: %v: %s", err, b)
	}
	raw, err := os.Open(img)
	if err != nil {
		return sandbox.LayerRef{}, err
	}
	defer raw.Close()
	f, err := os.Create(out)
	if err != nil {
		return sandbox.LayerRef{}, err
	}
	info, err := lsmt.Import(f, raw, lsmt.CommitOptions{})
	if cerr := f.Close(); err == nil {
		err = cerr
	}
	if err != nil {
		return sandbox.LayerRef{}, err
	}
	return sandbox.LayerRef{Path: out, Size: info.Size, UUID: info.UUID}, nil
}

func needBlock(t testing.TB) {
	t.Helper()
	needRuntime(t)
	for _, p := range []string{"/dev/fuse", "/dev/loop-control"} {
		if _, err := os.Stat(p); err != nil {
			t.Skipf("needs %s (FUSE and loop devices)", p)
		}
	}
	for _, tool := range []string{"mkfs.ext4", "resize2fs"} {
		if _, err := exec.LookPath(tool); err != nil {
			t.Skipf("needs %s (e2fsprogs)", tool)
		}
	}
}

func (e *testEnv) launchBlock(t *testing.T, id string, fs sandbox.RootFS, res sandbox.Resources) *Instance {
	t.Helper()
	return e.launchPlan(t, sandbox.LaunchPlan{Kind: sandbox.LaunchFresh, SandboxID: id, RootFS: fs, Resources: res, AllowInternet: true})
}

func (e *testEnv) launchPlan(t *testing.T, p sandbox.LaunchPlan) *Instance {
	t.Helper()
	inst, err := e.b.Launch(context.Background(), p)
	if err != nil {
		t.Fatal(err)
	}
	i := inst.(*Instance)
	e.waitReady(t, i)
	return i
}

// mustSh runs script in i and fails the test unless it exits 0.
func (e *testEnv) mustSh(t *testing.T, i *Instance, script string) string {
	t.Helper()
	out, code := e.sh(t, i, script)
	if code != 0 {
		t.Fatalf("%s: %q exited %d: %s", i.id, script, code, out)
	}
	return out
}

// blockLeftovers lists loop devices backed by, and mounts (FUSE, ext4) under, dir.
func blockLeftovers(t testing.TB, dir string) []string {
	t.Helper()
	var left []string
	loops, _ := filepath.Glob("/sys/block/loop*/loop/backing_file")
	for _, bf := range loops {
		if b, err := os.ReadFile(bf); err == nil && strings.Contains(string(b), dir) {
			left = append(left, "loop "+filepath.Base(filepath.Dir(filepath.Dir(bf)))+" -> "+strings.TrimSpace(string(b)))
		}
	}
	f, err := os.Open("/proc/self/mountinfo")
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		if f := strings.Fields(sc.Text()); len(f) > 4 && f[4] == filepath.Clean(dir) {
			continue // the data directory's bind onto itself, kept across restarts
		}
		if strings.Contains(sc.Text(), dir) {
			left = append(left, "mount "+sc.Text())
		}
	}
	return left
}

func layerFiles(t testing.TB, b *Backend) []string {
	t.Helper()
	ents, err := os.ReadDir(b.layersDir())
	if err != nil && !errors.Is(err, os.ErrNotExist) {
		t.Fatal(err)
	}
	var out []string
	for _, e := range ents {
		out = append(out, e.Name())
	}
	return out
}

// TestBlockSnapshotFork: a sandbox on a layered template writes, snapshots (and keeps
// running), writes again; three children of the snapshot see its state only, neither the
// source's later writes nor each other's; files owned by root on the template are root's
// inside (id-mapped mount); stopping everything leaves no mount, loop device or layer.
func TestBlockSnapshotFork(t *testing.T) {
	for _, mode := range []string{UserNSAuto, UserNSOff} {
		t.Run("userns="+mode, func(t *testing.T) { testBlockSnapshotFork(t, mode) })
	}
}

func testBlockSnapshotFork(t *testing.T, mode string) {
	e := newTestBackend(t, func(c *Config) { c.UserNamespace = mode })
	fs := testLayered(t)
	ctx := context.Background()
	a := e.launchBlock(t, "blk-a", fs, sandbox.Resources{CPUCount: 1, MemoryMB: 256})
	if out := e.mustSh(t, a, "id -u; stat -c '%u:%g' /etc/passwd /bin; stat -c %U /home/user"); out != "0\n0:0\n0:0\nuser\n" {
		t.Fatalf("ownership inside (userns=%v): %q", e.b.UserNamespaces(), out)
	}
	e.mustSh(t, a, "echo one > /root/state && mkdir -p /home/user/w && echo keep > /home/user/w/f && rm /etc/motd 2>/dev/null; sync -f /")
	c, err := a.Snapshot(ctx)
	if err != nil {
		t.Fatal(err)
	}
	capd := c.(*Captured)
	t.Logf("snapshot: %d layers, frozen %dµs, total %dµs", len(capd.Layers), capd.FrozenMicros, capd.TotalMicros)
	// Same sandbox, still running, on a fresh upper.
	e.mustSh(t, a, "echo two > /root/state && echo later > /root/later")
	if out := e.mustSh(t, a, "cat /root/state"); out != "two\n" {
		t.Fatalf("source after snapshot: %q", out)
	}
	// The capture survives an encode/decode round trip (the orchestrator stores it).
	raw, err := c.Encode()
	if err != nil {
		t.Fatal(err)
	}
	dc, err := e.b.DecodeCaptured(raw)
	if err != nil {
		t.Fatal(err)
	}
	var kids []*Instance
	for n := range 3 {
		kids = append(kids, e.launchPlan(t, sandbox.LaunchPlan{Kind: sandbox.LaunchFromSnapshot,
			SandboxID: fmt.Sprintf("blk-k%d", n), Snapshot: dc, Resources: sandbox.Resources{CPUCount: 1, MemoryMB: 128}}))
	}
	for n, k := range kids {
		if out := e.mustSh(t, k, "cat /root/state /home/user/w/f; test -e /root/later && echo LEAK; id -u"); out != "one\nkeep\n0\n" {
			t.Fatalf("child %d sees %q", n, out)
		}
		e.mustSh(t, k, fmt.Sprintf("echo child%d > /root/mine", n))
	}
	for n, k := range kids {
		if out := e.mustSh(t, k, "cat /root/mine"); out != fmt.Sprintf("child%d\n", n) {
			t.Fatalf("child %d: own file %q", n, out)
		}
	}
	if out, _ := e.sh(t, a, "cat /root/mine"); !strings.Contains(out, "No such file") {
		t.Fatalf("source sees a child's write: %q", out)
	}
	// Discarding the capture keeps the layer: the source and the children still use it.
	if err := e.b.DiscardSnapshot(ctx, dc); err != nil {
		t.Fatal(err)
	}
	if l := layerFiles(t, e.b); len(l) != 1 {
		t.Fatalf("layers after discard with users: %v", l)
	}
	for _, k := range append(kids, a) {
		if err := k.Stop(ctx); err != nil {
			t.Fatal(err)
		}
	}
	if l := layerFiles(t, e.b); len(l) != 0 {
		t.Fatalf("layers left after every user stopped: %v", l)
	}
	if left := blockLeftovers(t, e.cfg.DataDir); len(left) > 0 {
		t.Fatalf("left behind: %v", left)
	}
}

// TestBlockFork uses Instance.Fork (one snapshot, N launches).
func TestBlockFork(t *testing.T) {
	e := newTestBackend(t, nil)
	fs := testLayered(t)
	ctx := context.Background()
	a := e.launchBlock(t, "fork-a", fs, sandbox.Resources{CPUCount: 1, MemoryMB: 128})
	e.mustSh(t, a, "echo base > /root/f")
	specs := []sandbox.ForkSpec{{SandboxID: "fork-1"}, {SandboxID: "fork-2"}, {SandboxID: "fork-a"}}
	res, err := a.Fork(ctx, specs)
	if err != nil {
		t.Fatal(err)
	}
	if len(res) != 3 || !errors.Is(res[2].Err, ErrExists) {
		t.Fatalf("results %+v (the duplicate id must fail alone)", res)
	}
	for n, r := range res[:2] {
		if r.Err != nil {
			t.Fatalf("child %d: %v", n, r.Err)
		}
		k := r.Instance.(*Instance)
		e.waitReady(t, k)
		if out := e.mustSh(t, k, "cat /root/f"); out != "base\n" {
			t.Fatalf("child %d: %q", n, out)
		}
	}
	if ents, _ := os.ReadDir(e.b.capturesDir()); len(ents) != 0 {
		t.Fatalf("fork left capture records: %v", ents)
	}
}

// TestBlockPauseToDisk: pause without memory snapshots and stops the sandbox; resume
// relaunches it under the same id with its files; a kill while paused frees the layers.
func TestBlockPauseToDisk(t *testing.T) {
	e := newTestBackend(t, nil)
	fs := testLayered(t)
	ctx := context.Background()
	a := e.launchBlock(t, "pd-a", fs, sandbox.Resources{CPUCount: 1, MemoryMB: 128})
	e.mustSh(t, a, "echo kept > /root/f && dd if=/dev/urandom of=/root/rand bs=1M count=4 2>/dev/null && md5sum /root/rand > /root/rand.md5")
	// A sandbox has its own boot id, and a resume with fresh processes (a reboot, to
	// what runs in it) gets a new one.
	host, err := os.ReadFile(bootIDPath)
	if err != nil {
		t.Fatal(err)
	}
	bootA := e.mustSh(t, a, "cat "+bootIDPath)
	if len(bootA) != 37 || bootA == string(host) {
		t.Fatalf("boot id %q (host's %q)", bootA, host)
	}
	if out := e.mustSh(t, a, "echo x > "+bootIDPath+" 2>&1 || echo refused"); !strings.Contains(out, "refused") {
		t.Fatalf("the boot id is writable: %q", out)
	}
	ps, err := a.Pause(ctx, sandbox.PauseOptions{KeepMemory: false})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := a.Status(ctx); !errors.Is(err, sandbox.ErrGone) {
		t.Fatalf("paused to disk, container still there: %v", err)
	}
	if left := blockLeftovers(t, e.b.layout("pd-a").dir); len(left) > 0 {
		t.Fatalf("paused sandbox holds: %v", left)
	}
	raw, err := ps.Encode()
	if err != nil {
		t.Fatal(err)
	}
	ps2, err := e.b.DecodePaused(raw)
	if err != nil {
		t.Fatal(err)
	}
	r := e.launchPlan(t, sandbox.LaunchPlan{Kind: sandbox.LaunchResume, SandboxID: "pd-a", Paused: ps2,
		Resources: sandbox.Resources{CPUCount: 1, MemoryMB: 128}})
	if out := e.mustSh(t, r, "cat /root/f; md5sum -c /root/rand.md5"); out != "kept\n/root/rand: OK\n" {
		t.Fatalf("after resume: %q", out)
	}
	if bootR := e.mustSh(t, r, "cat "+bootIDPath); len(bootR) != 37 || bootR == bootA || bootR == string(host) {
		t.Fatalf("boot id after a resume from disk %q, before %q", bootR, bootA)
	}
	// Pause again and kill while paused: the capture and its layers go.
	ps3, err := r.Pause(ctx, sandbox.PauseOptions{})
	if err != nil {
		t.Fatal(err)
	}
	if err := e.b.DiscardPaused(ctx, "pd-a", ps3); err != nil {
		t.Fatal(err)
	}
	if l := layerFiles(t, e.b); len(l) != 0 {
		t.Fatalf("layers left after a kill while paused: %v", l)
	}
	// KeepMemory still freezes in place.
	k := e.launchBlock(t, "pd-b", fs, sandbox.Resources{})
	bootK := e.mustSh(t, k, "cat "+bootIDPath)
	if _, err := k.Pause(ctx, sandbox.PauseOptions{KeepMemory: true}); err != nil {
		t.Fatal(err)
	}
	if st, _ := k.Status(ctx); st != "paused" {
		t.Fatalf("memory pause: status %q", st)
	}
	// Thawed in place, its processes never stopped: the same boot.
	if err := k.Resume(ctx); err != nil {
		t.Fatal(err)
	}
	if again := e.mustSh(t, k, "cat "+bootIDPath); again != bootK {
		t.Fatalf("boot id changed across a freeze: %q -> %q", bootK, again)
	}
}

// TestBlockDiskSize: a disk larger than the template's grows the filesystem.
func TestBlockDiskSize(t *testing.T) {
	e := newTestBackend(t, nil)
	fs := testLayered(t)
	a := e.launchBlock(t, "disk-a", fs, sandbox.Resources{DiskSizeMB: 1024})
	out := e.mustSh(t, a, "df -m / | tail -1")
	var dev string
	var size int
	if _, err := fmt.Sscan(out, &dev, &size); err != nil || size < 900 {
		t.Fatalf("df: %q (%v)", out, err)
	}
	st, err := a.Stats(context.Background())
	if err != nil || st.DiskTotal < 900<<20 || st.DiskUsed <= 0 {
		t.Fatalf("stats %+v %v", st, err)
	}
	// A snapshot keeps the grown size.
	c, err := a.Snapshot(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	if vs := c.(*Captured).VirtualSize; vs != 1024<<20 {
		t.Fatalf("capture of %d bytes", vs)
	}
	if err := e.b.DiscardSnapshot(context.Background(), c); err != nil {
		t.Fatal(err)
	}
}

// TestBlockCrashRecovery drops a backend with block sandboxes running (a crash: the FUSE
// servers die with the node) and checks a new backend's Reconcile removes them and every
// mount, loop device and FUSE mount, and keeps the layers of capture records (a sandbox
// paused to disk) while dropping unreferenced ones.
func TestBlockCrashRecovery(t *testing.T) {
	e := newTestBackend(t, nil)
	fs := testLayered(t)
	ctx := context.Background()
	a := e.launchBlock(t, "crash-blk", fs, sandbox.Resources{})
	p := e.launchBlock(t, "crash-paused", fs, sandbox.Resources{})
	e.mustSh(t, p, "echo p > /root/p")
	ps, err := p.Pause(ctx, sandbox.PauseOptions{})
	if err != nil {
		t.Fatal(err)
	}
	// An unreferenced layer, as a crash between seal and record can leave.
	if err := os.WriteFile(filepath.Join(e.b.layersDir(), "orphan.commit"), []byte("x"), 0o600); err != nil {
		t.Fatal(err)
	}
	// "Crash": the old backend forgets its sandbox without stopping it.
	e.b.mu.Lock()
	delete(e.b.instances, "crash-blk")
	e.b.mu.Unlock()
	slot := traceSlot(t, a.slot)
	cfg := e.cfg
	b2, err := New(ctx, cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { cleanupBackend(t, b2) })
	alive, err := b2.Reconcile(ctx, []string{"crash-blk", "crash-paused"})
	if err != nil {
		t.Fatal(err)
	}
	if len(alive) != 0 {
		t.Fatalf("alive %v: block sandboxes cannot be adopted", alive)
	}
	// The dead node's FUSE server and stack go with its process; here, close them by hand.
	a.mu.Lock()
	_ = blockOf(a).Close()
	a.mu.Unlock()
	assertGone(t, b2, "crash-blk", slot)
	if left := blockLeftovers(t, cfg.DataDir); len(left) > 0 {
		t.Fatalf("left behind: %v", left)
	}
	if l := layerFiles(t, b2); len(l) != 1 || l[0] == "orphan.commit" {
		t.Fatalf("layers after reconcile: %v (want the paused sandbox's only)", l)
	}
	e2 := &testEnv{b: b2, cfg: b2.cfg, template: e.template}
	r := e2.launchPlan(t, sandbox.LaunchPlan{Kind: sandbox.LaunchResume, SandboxID: "crash-paused", Paused: ps})
	if out := e2.mustSh(t, r, "cat /root/p"); out != "p\n" {
		t.Fatalf("resumed after crash: %q", out)
	}
	// Reset the old backend's view so its cleanup does not touch what b2 now owns.
	e.b.mu.Lock()
	e.b.instances = map[string]*Instance{}
	e.b.mu.Unlock()
}

// TestBlockWarm: warm containers of a layered template come with their block root
// mounted; a launch takes one and it snapshots like any other; Close releases the rest.
func TestBlockWarm(t *testing.T) {
	e := newTestBackend(t, func(c *Config) { c.WarmContainers = 1 })
	fs := testLayered(t)
	ctx := context.Background()
	e.launchBlock(t, "bw0", fs, sandbox.Resources{})
	waitWarm(t, e.b, blockKey(layerRefs(fs.Layers), nil, fs.VirtualSize), 1)
	i := e.launchBlock(t, "bw1", fs, sandbox.Resources{})
	if !strings.HasPrefix(i.cid, "warm.") || !i.isBlock() {
		t.Fatalf("second launch: cid %s, block %v", i.cid, i.isBlock())
	}
	e.mustSh(t, i, "echo w > /root/w")
	c, err := i.Snapshot(ctx)
	if err != nil {
		t.Fatal(err)
	}
	k := e.launchPlan(t, sandbox.LaunchPlan{Kind: sandbox.LaunchFromSnapshot, SandboxID: "bw2", Snapshot: c})
	if out := e.mustSh(t, k, "cat /root/w"); out != "w\n" {
		t.Fatalf("child of a warm sandbox: %q", out)
	}
	if err := e.b.DiscardSnapshot(ctx, c); err != nil {
		t.Fatal(err)
	}
	if err := e.b.Close(ctx); err != nil {
		t.Fatal(err)
	}
	for _, inst := range []*Instance{i, k} {
		if err := inst.Stop(ctx); err != nil {
			t.Fatal(err)
		}
	}
	e.b.mu.Lock()
	for _, inst := range e.b.instances {
		e.b.mu.Unlock()
		inst.Stop(ctx)
		e.b.mu.Lock()
	}
	e.b.mu.Unlock()
	if left := blockLeftovers(t, e.cfg.DataDir); len(left) > 0 {
		t.Fatalf("left behind: %v", left)
	}
}

// TestOverlayCannotSnapshot: a sandbox on a directory template refuses snapshot and fork
// with sandbox.ErrUnsupported (not ErrGone: it keeps running), and a pause without memory
// freezes it in place.
func TestOverlayCannotSnapshot(t *testing.T) {
	e := newTestBackend(t, nil)
	ctx := context.Background()
	i := e.launch(t, "ov1", sandbox.Resources{})
	if _, err := i.Snapshot(ctx); !errors.Is(err, sandbox.ErrUnsupported) || errors.Is(err, sandbox.ErrGone) {
		t.Fatalf("snapshot: %v", err)
	}
	if _, err := i.Fork(ctx, []sandbox.ForkSpec{{SandboxID: "ov2"}}); !errors.Is(err, sandbox.ErrUnsupported) {
		t.Fatalf("fork: %v", err)
	}
	if err := probeHealth(i, time.Second); err != nil {
		t.Fatalf("sandbox hurt by a refused snapshot: %v", err)
	}
	ps, err := i.Pause(ctx, sandbox.PauseOptions{KeepMemory: false})
	if err != nil {
		t.Fatal(err)
	}
	if p := ps.(pausedState); p.Disk != nil {
		t.Fatalf("overlay sandbox paused to disk: %+v", p)
	}
	if st, _ := i.Status(ctx); st != "paused" {
		t.Fatalf("status %q", st)
	}
}

// digestResolver serves layers by digest from local files (standing in for a repository
// behind the node's block cache) and counts what it opened.
type digestResolver struct {
	files map[string]string
	mu    sync.Mutex
	opens int
}

type fileSource struct {
	*os.File
	size int64
}

func (f fileSource) Size() int64 { return f.size }

func (r *digestResolver) OpenLayer(_ context.Context, ref stack.LayerRef) (stack.Source, error) {
	p, ok := r.files[ref.Digest]
	if !ok {
		return nil, fmt.Errorf("no blob %s", ref.Digest)
	}
	f, err := os.Open(p)
	if err != nil {
		return nil, err
	}
	fi, err := f.Stat()
	if err != nil {
		f.Close()
		return nil, err
	}
	r.mu.Lock()
	r.opens++
	r.mu.Unlock()
	return fileSource{File: f, size: fi.Size()}, nil
}

// TestBlockLayerByDigest: a template whose layers have only digests launches through
// Config.LayerResolver, and its snapshots (digest lowers plus local sealed layers) fork.
func TestBlockLayerByDigest(t *testing.T) {
	fs := testLayered(t)
	res := &digestResolver{files: map[string]string{"sha256:base": fs.Layers[0].Path}}
	byDigest := sandbox.RootFS{Layers: []sandbox.LayerRef{{Digest: "sha256:base", Size: fs.Layers[0].Size}}, VirtualSize: fs.VirtualSize}
	plain := newTestBackend(t, nil)
	if _, err := plain.b.Launch(context.Background(), sandbox.LaunchPlan{Kind: sandbox.LaunchFresh, SandboxID: "dg0", RootFS: byDigest}); err == nil {
		t.Fatal("a digest-only layer launched without a resolver")
	}
	e := newTestBackend(t, func(c *Config) {
		c.LayerResolver = res
		c.Network.Bridge, c.Network.Prefix, c.Network.Subnet = "aenvocit1", "aenvou", "10.89.17.0/24"
	})
	a := e.launchBlock(t, "dg1", byDigest, sandbox.Resources{})
	e.mustSh(t, a, "test -x /bin/busybox && echo d > /root/d")
	res2, err := a.Fork(context.Background(), []sandbox.ForkSpec{{SandboxID: "dg2"}})
	if err != nil || res2[0].Err != nil {
		t.Fatalf("fork: %v %v", err, res2)
	}
	k := res2[0].Instance.(*Instance)
	e.waitReady(t, k)
	if out := e.mustSh(t, k, "cat /root/d"); out != "d\n" {
		t.Fatalf("child: %q", out)
	}
	if res.opens < 2 {
		t.Fatalf("resolver opened %d layers, want one per root", res.opens)
	}
}
