package oci

import (
	"context"
	"net"
	"os/exec"
	"path/filepath"
	"testing"

	"github.com/aenv-dev/aenv/internal/dataplane"
	"github.com/aenv-dev/aenv/internal/sandbox"
)

// startDataPlane serves a data plane on a socket in a temp dir for the test's life.
func startDataPlane(t *testing.T) *dataplane.Client {
	t.Helper()
	dir := t.TempDir()
	sock := filepath.Join(dir, "dp.sock")
	ln, err := net.Listen("unix", sock)
	if err != nil {
		t.Fatal(err)
	}
	srv := dataplane.NewServer("test", nil)
	srv.FUSEDir = dataplane.FUSEDir(dir) // as `aenv dataplane` serves: one mount for all disks
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { _ = srv.Serve(ctx, ln); close(done) }()
	t.Cleanup(func() {
		cancel()
		<-done
		if n := srv.NumDisks(); n > 0 {
			t.Errorf("the data plane still serves %d disks at the end", n)
		}
		srv.Close()
	})
	return dataplane.NewClient(sock)
}

// TestAdoptBlockRoot drops a backend whose layered roots the data plane serves (a node
// crash) and checks that a new backend adopts the running sandbox on its block root (same
// init, files intact, writable, snapshots work), removes the unknown one and closes its
// disk in the data plane, and that a stop afterwards leaves nothing.
func TestAdoptBlockRoot(t *testing.T) {
	dp := startDataPlane(t)
	e := newTestBackend(t, func(c *Config) { c.DataPlane = dp })
	fs := testLayered(t)
	ctx := context.Background()
	keep := e.launchBlock(t, "dp-keep", fs, sandbox.Resources{CPUCount: 1, MemoryMB: 128})
	lost := e.launchBlock(t, "dp-lost", fs, sandbox.Resources{CPUCount: 1, MemoryMB: 128})
	if !blockOf(keep).OutOfProcess() {
		t.Fatal("the root is not served by the data plane")
	}
	e.mustSh(t, keep, "echo kept > /root/mark && sync")
	pid := keep.pidOf(t)
	lostSlot := traceSlot(t, lost.slot)
	if got, _ := dp.List(ctx); len(got) != 2 {
		t.Fatalf("the data plane serves %d disks, want 2", len(got))
	}
	// The crash: this process's handles on the roots go; the data plane's stay.
	dev := blockOf(keep).Device()
	blockOf(keep).Abandon()
	blockOf(lost).Abandon()

	env2, adopted := e.restart(t, "dp-keep")
	b2 := env2.b
	if blockOf(adopted) == nil || blockOf(adopted).Device() != dev {
		t.Fatalf("adopted root %+v, was on %s", blockOf(adopted), dev)
	}
	if got := adopted.pidOf(t); got != pid {
		t.Fatalf("adopted init is pid %d, was %d", got, pid)
	}
	if out := env2.mustSh(t, adopted, "cat /root/mark && echo more > /root/more && cat /root/more"); out != "kept\nmore\n" {
		t.Fatalf("adopted sandbox reads %q", out)
	}
	c, err := adopted.Snapshot(ctx)
	if err != nil {
		t.Fatalf("snapshot of the adopted root: %v", err)
	}
	if err := b2.DiscardSnapshot(ctx, c); err != nil {
		t.Fatal(err)
	}
	assertGone(t, b2, lost.cid, lostSlot)
	if got, _ := dp.List(ctx); len(got) != 1 || got[0].Dir != absDir(adopted.l.dir) {
		t.Fatalf("the data plane serves %v, want only the adopted root", got)
	}
	if err := adopted.Stop(ctx); err != nil {
		t.Fatal(err)
	}
	if got, _ := dp.List(ctx); len(got) != 0 {
		t.Fatalf("the data plane still serves %v after the stop", got)
	}
}

// restart opens a second backend on e's configuration, as a node does after a crash (e's
// backend is simply no longer used), reconciles it wanting only sandbox id, checks that
// exactly that one is adopted and returns it with the new backend. The first backend
// forgets its instances when the test ends: they are the same sandboxes.
func (e *testEnv) restart(t *testing.T, id string) (*testEnv, *Instance) {
	t.Helper()
	ctx := context.Background()
	t.Cleanup(func() {
		e.b.mu.Lock()
		clear(e.b.instances)
		e.b.mu.Unlock()
	})
	b2, err := New(ctx, e.cfg)
	if err != nil {
		t.Fatal(err)
	}
	alive, err := b2.Reconcile(ctx, []string{id})
	if err != nil {
		t.Fatal(err)
	}
	adopted, ok := alive[id].(*Instance)
	if !ok || len(alive) != 1 {
		t.Fatalf("alive %v, want only %s", alive, id)
	}
	return &testEnv{b: b2, cfg: b2.cfg, template: e.template}, adopted
}

// pidOf is the host pid of the sandbox's init, from the runtime.
func (i *Instance) pidOf(t *testing.T) int {
	t.Helper()
	st, err := i.b.rt.state(context.Background(), i.cid)
	if err != nil {
		t.Fatal(err)
	}
	return st.Pid
}

// TestRestartKeepsHeldRuntime: a node that prefers crun (auto), restarted over sandboxes
// runc runs, adopts them with runc, the only runtime that lists, pauses and deletes them;
// once none is left, the next start picks crun.
func TestRestartKeepsHeldRuntime(t *testing.T) {
	if _, err := exec.LookPath("crun"); err != nil {
		t.Skip("needs crun (Debian package crun) to prefer")
	}
	dp := startDataPlane(t)
	e := newTestBackend(t, func(c *Config) { c.DataPlane, c.Runtime = dp, "runc" })
	ctx := context.Background()
	keep := e.launchBlock(t, "rt-keep", testLayered(t), sandbox.Resources{CPUCount: 1, MemoryMB: 128})
	pid := keep.pidOf(t)
	blockOf(keep).Abandon()

	e.cfg.Runtime = "auto"
	env2, adopted := e.restart(t, "rt-keep")
	if got := env2.b.Runtime(); got != "runc" {
		t.Fatalf("the restarted node runs %s, not runc whose sandbox it holds", got)
	}
	if got := adopted.pidOf(t); got != pid {
		t.Fatalf("adopted init is pid %d, was %d", got, pid)
	}
	if _, err := adopted.Pause(ctx, sandbox.PauseOptions{KeepMemory: true}); err != nil {
		t.Fatal(err)
	}
	if st, _ := adopted.Status(ctx); st != "paused" {
		t.Fatalf("memory pause: status %q", st)
	}
	if err := adopted.Resume(ctx); err != nil {
		t.Fatal(err)
	}
	if out := env2.mustSh(t, adopted, "echo still"); out != "still\n" {
		t.Fatalf("adopted sandbox answers %q", out)
	}
	if err := adopted.Stop(ctx); err != nil {
		t.Fatal(err)
	}
	if err := env2.b.Close(ctx); err != nil {
		t.Fatal(err)
	}
	b3, err := New(ctx, env2.cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { cleanupBackend(t, b3) })
	if got := b3.Runtime(); got != "crun" {
		t.Fatalf("with no sandbox held the node runs %s, want crun", got)
	}
}
