package oci

import (
	"context"
	"maps"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"testing"

	"github.com/aenv-dev/aenv/internal/sandbox"
	"golang.org/x/sys/unix"
)

// TestCrashRecovery drops a backend without stopping its sandboxes (as a node crash does),
// then checks that a new backend adopts the sandboxes it is told about, still reachable, and
// removes everything else: containers, cgroups, overlay mounts, bundles, network slots.
func TestCrashRecovery(t *testing.T) {
	// The first backend keeps one warm container; its filler is stopped before the "crash"
	// so nothing of it runs on in this process and races the new backend.
	e := newTestBackend(t, func(c *Config) { c.Network.PoolSize, c.WarmContainers = -1, 1 })
	ctx := context.Background()
	keep := e.launch(t, "crash-keep", sandbox.Resources{CPUCount: 1, MemoryMB: 128})
	lost := e.launch(t, "crash-lost", sandbox.Resources{CPUCount: 1, MemoryMB: 128})
	lostSlot := traceSlot(t, lost.slot)
	t.Logf("lost runs in container %s", lost.cid)
	e.sh(t, keep, "echo kept > /root/mark")
	waitWarm(t, e.b, e.template, 1)
	close(e.b.warm.done)
	<-e.b.warm.exited
	e.b.warm.mu.Lock()
	warmCid := e.b.warm.ready[e.template][0].cid
	e.b.warm.ready = map[string][]*Instance{} // "forgotten" by the crash
	e.b.warm.closed = true
	e.b.warm.mu.Unlock()
	// A launch that crashed half-way: a bundle with a mounted rootfs and no container.
	ghost := e.b.layout("crash-ghost")
	if err := os.MkdirAll(ghost.rootfs(), 0o755); err != nil {
		t.Fatal(err)
	}
	if err := unix.Mount("tmpfs", ghost.rootfs(), "tmpfs", 0, ""); err != nil {
		t.Fatal(err)
	}

	// Reconcile reads runc's state files itself: it must see what `runc list` says
	// (two running containers, one created warm one).
	assertStatesMatchRunc(t, e.b.rt)

	// No warm pool here either: it would refill freed slot indexes, and the checks below
	// look for the old slots' names.
	cfg := e.cfg
	cfg.WarmContainers = -1
	b2, err := New(ctx, cfg)
	if err != nil {
		t.Fatal(err)
	}
	alive, err := b2.Reconcile(ctx, []string{"crash-keep", "crash-unknown"})
	if err != nil {
		t.Fatal(err)
	}
	if len(alive) != 1 || alive["crash-keep"] == nil {
		t.Fatalf("alive %v, want only crash-keep", alive)
	}
	adopted := alive["crash-keep"].(*Instance)
	if adopted.Endpoint() != keep.Endpoint() {
		t.Fatalf("adopted endpoint %v, was %v", adopted.Endpoint(), keep.Endpoint())
	}
	if err := probeHealth(adopted, 2e9); err != nil {
		t.Fatalf("adopted sandbox unreachable: %v", err)
	}
	env2 := &testEnv{b: b2, cfg: b2.cfg, template: e.template}
	if out, _ := env2.sh(t, adopted, "cat /root/mark"); out != "kept\n" {
		t.Fatalf("adopted sandbox lost its files: %q", out)
	}
	assertGone(t, b2, lost.cid, lostSlot)
	assertGone(t, b2, "crash-ghost", nil)
	assertGone(t, b2, warmCid, nil)

	// Second crash, and this time the node knows nothing: everything goes.
	keepSlot := traceSlot(t, adopted.slot)
	b3, err := New(ctx, cfg)
	if err != nil {
		t.Fatal(err)
	}
	alive, err = b3.Reconcile(ctx, nil)
	if err != nil {
		t.Fatal(err)
	}
	if len(alive) != 0 {
		t.Fatalf("alive %v after Reconcile(nil)", alive)
	}
	assertGone(t, b3, adopted.cid, keepSlot)
	if err := b2.Close(ctx); err != nil {
		t.Fatal(err)
	}
	if err := b3.pool.Teardown(ctx); err != nil {
		t.Fatal(err)
	}
	assertClean(t, b3)
	if ents, _ := os.ReadDir(filepath.Join(cfg.DataDir, "sandboxes")); len(ents) != 0 {
		t.Fatalf("bundles left: %v", ents)
	}
}

// assertStatesMatchRunc checks that the state files read directly give the ids and
// statuses `runc list` gives (a paused container counts as running).
func assertStatesMatchRunc(t *testing.T, rt runtimeCLI) {
	t.Helper()
	if rt.name != "runc" {
		return
	}
	listed, err := rt.list(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	read, ok := readRuncStates(rt.root, "/proc")
	if !ok {
		t.Fatal("runc's state files not understood")
	}
	norm := func(sts []containerState) map[string]string {
		m := map[string]string{}
		for _, c := range sts {
			if c.Status == "paused" {
				c.Status = "running"
			}
			m[c.ID] = c.Status
		}
		return m
	}
	if a, b := norm(read), norm(listed); !maps.Equal(a, b) || len(a) < 3 {
		t.Fatalf("state files say %v, runc list says %v", a, b)
	}
}

// TestCrashMidClaim stops a warm container's claim after its limits are set and before its
// state is saved (the hostname fails), then restarts the backend knowing the sandbox: a
// claim that never finished must not be adopted (it could lack its limits), it is removed
// with the other debris.
func TestCrashMidClaim(t *testing.T) {
	e := newTestBackend(t, func(c *Config) { c.Network.PoolSize, c.WarmContainers = -1, 1 })
	ctx := context.Background()
	// A launch makes the template wanted; the pool refills behind it.
	if err := e.launch(t, "mid-claim-first", sandbox.Resources{}).Stop(ctx); err != nil {
		t.Fatal(err)
	}
	waitWarm(t, e.b, e.template, 1)
	close(e.b.warm.done)
	<-e.b.warm.exited
	e.b.warm.mu.Lock()
	w := e.b.warm.ready[e.template][0]
	e.b.warm.ready = map[string][]*Instance{}
	e.b.warm.closed = true
	e.b.warm.mu.Unlock()

	plan := sandbox.LaunchPlan{
		Kind: sandbox.LaunchFresh, SandboxID: "mid-claim", RootFS: sandbox.RootFS{LowerDir: e.template},
		Resources: sandbox.Resources{CPUCount: 1, MemoryMB: 96}, AllowInternet: true,
	}
	// No process has pid 0 in /proc: the claim fails where the node would have stopped.
	err := e.b.claimWarm(ctx, w, 0, plan)
	if err == nil || !strings.Contains(err.Error(), "uts namespace") {
		t.Fatalf("claim with no init: %v, want the uts namespace's error", err)
	}
	limit := filepath.Join(cgroupRoot, "memory", e.b.cgroupsPath(w.cid), "memory.limit_in_bytes")
	if e.b.v2 {
		limit = filepath.Join(cgroupRoot, e.b.cgroupsPath(w.cid), "memory.max")
	}
	if got, err := os.ReadFile(limit); err != nil || strings.TrimSpace(string(got)) != strconv.Itoa(96<<20) {
		t.Fatalf("memory limit before the hostname: %q, %v; want the claim to have set it", got, err)
	}

	cfg := e.cfg
	cfg.WarmContainers = -1
	b2, err := New(ctx, cfg)
	if err != nil {
		t.Fatal(err)
	}
	alive, err := b2.Reconcile(ctx, []string{"mid-claim"})
	if err != nil {
		t.Fatal(err)
	}
	if len(alive) != 0 {
		for _, inst := range alive {
			inst.Stop(ctx) // leave nothing running behind the failure
		}
		t.Fatalf("adopted %v: a claim that never saved its state", slices.Collect(maps.Keys(alive)))
	}
	assertGone(t, b2, w.cid, nil)
	if err := b2.Close(ctx); err != nil {
		t.Fatal(err)
	}
	assertClean(t, b2)
}
