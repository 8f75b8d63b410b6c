package oci

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/aenv-dev/aenv/internal/rootfs"
	"github.com/aenv-dev/aenv/internal/sandbox"
)

// overlayOf is i's overlay root, nil when it has none.
func overlayOf(i *Instance) *rootfs.Overlay {
	r, _ := i.root.(overlayRoot)
	return r.Overlay
}

// lowerMounts lists the shared lowers mounted now (their filesystems, not the FUSE
// mounts of their disks served in this process).
func lowerMounts(t *testing.T, b *Backend) []string {
	t.Helper()
	m, err := mountsUnder(b.lowers.Dir())
	if err != nil {
		t.Fatal(err)
	}
	var out []string
	for _, p := range m {
		if filepath.Base(p) == "root" {
			out = append(out, p)
		}
	}
	return out
}

// TestOverlayRoots: with OverlayRoots, sandboxes on a layered template run on overlay
// roots over one shared lower (files owned by the sandbox's root as on a block root,
// writes apart); a snapshot captures the upper, and children launched from it, a fork
// and a resume from disk see its state and not each other's; stopping everything leaves
// no mount, loop device, layer or lower.
func TestOverlayRoots(t *testing.T) {
	for _, mode := range []string{UserNSAuto, UserNSOff} {
		t.Run("userns="+mode, func(t *testing.T) { testOverlayRoots(t, mode) })
	}
}

func testOverlayRoots(t *testing.T, mode string) {
	e := newTestBackend(t, func(c *Config) { c.UserNamespace, c.OverlayRoots = mode, true })
	fs := testLayered(t)
	ctx := context.Background()
	res := sandbox.Resources{CPUCount: 1, MemoryMB: 128}
	a := e.launchBlock(t, "ov-a", fs, res)
	b := e.launchBlock(t, "ov-b", fs, res)
	if overlayOf(a) == nil || overlayOf(b) == nil {
		t.Fatal("sandboxes are not on overlay roots")
	}
	if out := e.mustSh(t, a, "id -u; stat -c '%u:%g' /etc/passwd /bin; stat -c %U /home/user; stat -f -c %t /"); out != "0\n0:0\n0:0\nuser\n794c7630\n" {
		t.Fatalf("ownership and root inside (userns=%v): %q", e.b.UserNamespaces(), out)
	}
	if m := lowerMounts(t, e.b); len(m) != 1 {
		t.Fatalf("shared lowers mounted: %v, want one for both sandboxes", m)
	}
	// A template build's sandbox gets a block root: its capture is one stack.
	flat := e.launchPlan(t, sandbox.LaunchPlan{Kind: sandbox.LaunchFresh, SandboxID: "ov-flat", RootFS: fs, Resources: res, FlatRoot: true})
	if blockOf(flat) == nil {
		t.Fatal("a flat root is not a block root")
	}
	fc, err := flat.Snapshot(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if u := fc.(*Captured).Upper; len(u) != 0 {
		t.Fatalf("a flat root's capture has upper layers %v", u)
	}
	if err := e.b.DiscardSnapshot(ctx, fc); err != nil {
		t.Fatal(err)
	}
	if err := flat.Stop(ctx); err != nil {
		t.Fatal(err)
	}
	e.mustSh(t, a, "echo one > /root/state && mkdir -p /home/user/w && echo keep > /home/user/w/f && chown user /home/user/w/f && rm /etc/hostname; sync -f /")
	if out, _ := e.sh(t, b, "cat /root/state"); !strings.Contains(out, "No such file") {
		t.Fatalf("b sees a's write: %q", out)
	}
	c, err := a.Snapshot(ctx)
	if err != nil {
		t.Fatal(err)
	}
	capd := c.(*Captured)
	if len(capd.Upper) != 2 || len(capd.Layers) != len(fs.Layers) {
		t.Fatalf("capture of an overlay root: %d layers, %d upper (want the template's %d and 2)", len(capd.Layers), len(capd.Upper), len(fs.Layers))
	}
	e.mustSh(t, a, "echo two > /root/state && echo later > /root/later")
	raw, err := c.Encode()
	if err != nil {
		t.Fatal(err)
	}
	dc, err := e.b.DecodeCaptured(raw)
	if err != nil {
		t.Fatal(err)
	}
	var kids []*Instance
	for n := range 2 {
		kids = append(kids, e.launchPlan(t, sandbox.LaunchPlan{Kind: sandbox.LaunchFromSnapshot,
			SandboxID: fmt.Sprintf("ov-k%d", n), Snapshot: dc, Resources: res}))
	}
	for n, k := range kids {
		if out := e.mustSh(t, k, "cat /root/state /home/user/w/f; stat -c %U /home/user/w/f; test -e /root/later && echo LEAK; test -e /etc/hostname && echo BACK; id -u"); out != "one\nkeep\nuser\n0\n" {
			t.Fatalf("child %d sees %q", n, out)
		}
		e.mustSh(t, k, fmt.Sprintf("echo child%d > /root/mine", n))
	}
	if out := e.mustSh(t, kids[1], "cat /root/mine"); out != "child1\n" {
		t.Fatalf("child 1: own file %q", out)
	}
	if err := e.b.DiscardSnapshot(ctx, dc); err != nil {
		t.Fatal(err)
	}
	// A fork of a child: its capture is the child's upper over the same lower.
	fr, err := kids[0].Fork(ctx, []sandbox.ForkSpec{{SandboxID: "ov-f", Resources: res}})
	if err != nil || fr[0].Err != nil {
		t.Fatalf("fork: %v %v", err, fr)
	}
	f := fr[0].Instance.(*Instance)
	e.waitReady(t, f)
	if out := e.mustSh(t, f, "cat /root/state /root/mine"); out != "one\nchild0\n" {
		t.Fatalf("fork sees %q", out)
	}
	// Pause to disk and resume under the same id.
	ps, err := b.Pause(ctx, sandbox.PauseOptions{})
	if err != nil {
		t.Fatal(err)
	}
	e.mustSh(t, a, "true") // a still runs
	r := e.launchPlan(t, sandbox.LaunchPlan{Kind: sandbox.LaunchResume, SandboxID: "ov-b", Paused: ps, Resources: res})
	if overlayOf(r) == nil {
		t.Fatal("resumed sandbox is not on an overlay root")
	}
	if m := lowerMounts(t, e.b); len(m) != 1 {
		t.Fatalf("shared lowers mounted: %v, want one for all", m)
	}
	for _, i := range append(kids, a, f, r) {
		if err := i.Stop(ctx); err != nil {
			t.Fatal(err)
		}
	}
	if l := layerFiles(t, e.b); len(l) != 0 {
		t.Fatalf("layers left after every user stopped: %v", l)
	}
	if left := blockLeftovers(t, e.cfg.DataDir); len(left) > 0 {
		t.Fatalf("left behind: %v", left)
	}
	if ents, _ := os.ReadDir(e.b.lowers.Dir()); len(ents) != 0 {
		t.Fatalf("shared lowers' directories left: %v", ents)
	}
}

// TestAdoptOverlayRoot: a node crash leaves overlay roots, their uppers' disks and the
// shared lower to the data plane; a new backend adopts the running sandbox (same init,
// files, writable, snapshots), removes the other and keeps the lower for the adopted one;
// a stop afterwards leaves nothing.
func TestAdoptOverlayRoot(t *testing.T) {
	dp := startDataPlane(t)
	e := newTestBackend(t, func(c *Config) { c.DataPlane, c.OverlayRoots = dp, true })
	fs := testLayered(t)
	ctx := context.Background()
	keep := e.launchBlock(t, "ovdp-keep", fs, sandbox.Resources{CPUCount: 1, MemoryMB: 128})
	lost := e.launchBlock(t, "ovdp-lost", fs, sandbox.Resources{CPUCount: 1, MemoryMB: 128})
	if !keep.root.OutOfProcess() {
		t.Fatal("the root is not served by the data plane")
	}
	e.mustSh(t, keep, "echo kept > /root/mark && sync")
	pid := keep.pidOf(t)
	if got, _ := dp.List(ctx); len(got) != 3 {
		t.Fatalf("the data plane serves %d disks, want 3 (two uppers, one lower)", len(got))
	}
	// The crash: this process's handles on the roots and the lower go; the data plane's
	// stay.
	overlayOf(keep).Abandon()
	overlayOf(lost).Abandon()
	e.b.lowers.Abandon()

	env2, adopted := e.restart(t, "ovdp-keep")
	if overlayOf(adopted) == nil {
		t.Fatal("the adopted sandbox has no overlay root")
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
	if err := env2.b.DiscardSnapshot(ctx, c); err != nil {
		t.Fatal(err)
	}
	if got, _ := dp.List(ctx); len(got) != 2 {
		t.Fatalf("the data plane serves %v, want the adopted root's upper and its lower", got)
	}
	if err := adopted.Stop(ctx); err != nil {
		t.Fatal(err)
	}
	if got, _ := dp.List(ctx); len(got) != 0 {
		t.Fatalf("the data plane still serves %v after the stop", got)
	}
	if m := lowerMounts(t, env2.b); len(m) != 0 {
		t.Fatalf("shared lowers left mounted: %v", m)
	}
}
