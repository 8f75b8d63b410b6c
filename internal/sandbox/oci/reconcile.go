package oci

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"

	"golang.org/x/sync/errgroup"

	"github.com/aenv-dev/aenv/internal/dataplane"
	"github.com/aenv-dev/aenv/internal/rootfs"
	"github.com/aenv-dev/aenv/internal/sandbox"
	"github.com/aenv-dev/aenv/internal/steptime"
	"github.com/aenv-dev/aenv/internal/storage/blockdev"
)

// Reconcile implements sandbox.Backend. It adopts the containers of known ids that are
// still running or paused and removes everything else this backend owns: other containers
// in its runtime root, bundle directories and their mounts, loop devices and FUSE mounts
// of block roots, cgroups under CgroupParent, network slots, and layer files no capture
// record lists. Call it once at startup, before Launch.
//
// A sandbox on a block root is adopted when the data plane (Config.DataPlane) still
// serves its disk; one whose disk was served by the previous process itself has lost its
// root filesystem and is removed (a sandbox paused to disk is not affected: it has no
// container, only its capture). The data plane's disks of sandboxes not adopted are
// closed once the sweep has removed their mounts and loop devices. An overlay root is
// adopted over its shared lower, which is adopted first and kept while a sandbox is over
// it (sharedlower.go).
func (b *Backend) Reconcile(ctx context.Context, known []string) (map[string]sandbox.Instance, error) {
	want := map[string]bool{}
	for _, id := range known {
		want[id] = true
	}
	// How long each step took, logged at the end: a restart's time is mostly here.
	laps := steptime.Start()
	lap := laps.Lap
	// The runtime's containers, the data plane's disks and the mount table, side by side
	// (the data plane answers from its own process).
	var containers []containerState
	var disks map[string]dataplane.Info
	var mounts blockdev.Mounts
	var lg errgroup.Group
	lg.Go(func() (err error) { containers, err = b.rt.liveContainers(ctx); return err })
	lg.Go(func() (err error) {
		if disks, err = b.dataPlaneDisks(ctx); err != nil {
			// Without the list no root can be adopted, and none may be swept either: its
			// disk may still be served. Fail the start rather than lose the sandboxes.
			return fmt.Errorf("oci: reconcile: list the data plane's disks: %w", err)
		}
		return nil
	})
	lg.Go(func() (err error) {
		// One read of the mount table for every root adopted (see blockdev.Mounts).
		if mounts, err = blockdev.ReadMounts(); err != nil {
			return fmt.Errorf("oci: reconcile: %w", err)
		}
		return nil
	})
	if err := lg.Wait(); err != nil {
		return nil, err
	}
	lap("list")
	// Shared lowers before the overlay roots over them (sharedlower.go).
	lowers := map[string]*rootfs.SharedLower{}
	if disks != nil {
		lowers = b.adoptLowers(disks, mounts)
	}
	var keepDirs []string // bundle dirs of adopted block roots
	var errs []error
	adopt := map[string]*Instance{}   // by sandbox id
	states := map[string]savedState{} // by sandbox id
	cids := map[string]bool{}         // container ids of adopted sandboxes
	var stale []string                // containers to delete
	var keptLowers []string           // directories of the shared lowers adopted roots are over
	for _, c := range b.adoptable(containers, want, disks, mounts, lowers) {
		if c.inst == nil {
			// Unknown, dead, or a warm container of the previous run (never started).
			stale = append(stale, c.id)
			continue
		}
		if c.info != nil {
			keepDirs = append(keepDirs, c.info.Dir)
		}
		if c.st.Lower != "" {
			keepDirs = append(keepDirs, c.inst.l.dir)
			keptLowers = append(keptLowers, filepath.Dir(c.st.Lower))
		}
		adopt[c.st.ID] = c.inst
		states[c.st.ID] = c.st
		cids[c.id] = true
	}
	// Kill every process of what is not adopted before the sweep below unmounts roots
	// under them: SIGKILL is queued even to a process stuck on a block root whose FUSE
	// server died, and takes effect once the sweep aborts the connection.
	keepDirs = append(keepDirs, keptLowers...)
	lap("adopt")
	b.killCgroups(cids)
	var gone []string
	kept := make(map[string]bool, len(keepDirs))
	for _, d := range keepDirs {
		kept[d] = true
	}
	for dir := range disks {
		if !kept[dir] {
			gone = append(gone, dir)
		}
	}
	// A thread can only hang on a FUSE connection of ours that the sweep aborts: one of a
	// root not adopted. The threads blocked on FUSE are listed before and after the sweep
	// (a host-wide scan of every task, ~0.2 s of CPU with a few hundred sandboxes) only
	// when there is such a root; a restart that adopts everything has none.
	sandboxes := absDir(filepath.Join(b.cfg.DataDir, "sandboxes"))
	var before []blockdev.Task
	scan := len(gone) > 0 || len(mounts.FUSEUnder(sandboxes, keepDirs...)) > 0
	if scan {
		before = blockdev.BlockedOnFUSE()
	}
	lap("kill_and_scan")
	// Block roots first (FUSE connections aborted, then ext4 mounts, loop devices, FUSE
	// mounts), except the adopted ones; overlay roots are left alone.
	errs = append(errs, rootfs.Sweep(ctx, filepath.Join(b.cfg.DataDir, "sandboxes"), keepDirs...))
	// Then the overlay roots over what it swept (their unmount syncs their uppers, whose
	// connections are aborted now if their server died), before the disks are closed.
	// Bundles without an adopted container: a crash between mount and run, or after the
	// container died.
	ents, err := os.ReadDir(filepath.Join(b.cfg.DataDir, "sandboxes"))
	if err != nil {
		return nil, fmt.Errorf("oci: list bundles: %w", err)
	}
	var orphans []layout
	for _, e := range ents {
		if !cids[e.Name()] {
			orphans = append(orphans, b.layout(e.Name()))
		}
	}
	errs = append(errs, b.detachOverlays(orphans, mounts))
	// Lowers no overlay root was adopted over are unmounted and their disks closed, once
	// the roots not adopted are detached (a lower's disk closes when they let go of it).
	errs = append(errs, b.releaseLowers(lowers))
	errs = append(errs, b.sweepLowers(ctx, keptLowers))
	if len(gone) > 0 {
		errs = append(errs, b.closeDisks(ctx, gone))
	}
	b.reportBlocked(before)
	lap("sweep_disks")
	errs = append(errs, b.removeContainers(ctx, stale))
	for _, l := range orphans {
		errs = append(errs, unmountAll(l.dir), os.RemoveAll(l.dir))
	}
	errs = append(errs, b.sweepCgroups(cids))
	lap("sweep_containers")

	keep := map[int]bool{}
	for _, st := range states {
		keep[st.SlotIndex] = st.AllowInternet
	}
	slots, err := b.pool.Reconcile(ctx, keep)
	errs = append(errs, err)
	lap("network")

	alive := map[string]sandbox.Instance{}
	for id, inst := range adopt {
		slot := slots[states[id].SlotIndex]
		if slot == nil {
			// Its network namespace is gone: the sandbox is unreachable, remove it (its
			// block root too).
			b.log.Warn("oci: reconcile: sandbox lost its network slot", "id", id)
			errs = append(errs, inst.Stop(ctx))
			continue
		}
		inst.slot = slot
		b.mu.Lock()
		b.instances[id] = inst
		b.mu.Unlock()
		alive[id] = inst
	}
	errs = append(errs, b.gcLayers())
	b.warm.start()
	lap("layers")
	b.log.Info("oci: reconciled", append([]any{"adopted", len(alive), "removed", len(stale)}, laps.Attrs()...)...)
	return alive, errors.Join(errs...)
}

// candidate is one container of the runtime as Reconcile finds it: inst is nil when it
// is not adopted (its container is removed).
type candidate struct {
	id   string
	st   savedState
	inst *Instance
	info *dataplane.Info // the data plane's disk of an adopted block root
}

// adoptable decides, for each container, whether it is adopted: running or paused, its
// saved state names a known sandbox that no earlier container claimed, and, on a block
// root, the data plane serves its disk and the root's mount is that disk's. Reading the
// saved states and checking the roots (a few sysfs reads and opens each) run a few at a
// time: a restart does it for every sandbox before any is served.
func (b *Backend) adoptable(containers []containerState, want map[string]bool, disks map[string]dataplane.Info,
	mounts blockdev.Mounts, lowers map[string]*rootfs.SharedLower) []candidate {
	cands := make([]candidate, len(containers))
	var g errgroup.Group
	g.SetLimit(8)
	for i, c := range containers {
		cands[i].id = c.ID
		if c.Status != "running" && c.Status != "paused" {
			continue
		}
		g.Go(func() error {
			st, err := readState(b.layout(c.ID).state())
			if st.ContainerID == "" {
				st.ContainerID = st.ID
			}
			if err == nil && st.ID != "" && want[st.ID] && st.ContainerID == c.ID {
				cands[i].st = st
				cands[i].inst = &Instance{b: b, id: st.ID, cid: c.ID, l: b.layout(c.ID), res: st.Resources, started: st.Created, idmap: st.IDMap}
			}
			return nil
		})
	}
	_ = g.Wait()
	// The first container of a sandbox id is its own; a second one is stale.
	seen := map[string]bool{}
	for i := range cands {
		c := &cands[i]
		if c.inst == nil {
			continue
		}
		if seen[c.st.ID] {
			c.inst = nil
			continue
		}
		seen[c.st.ID] = true
		if !c.st.Block {
			continue
		}
		diskDir := c.inst.l.dir
		if c.st.Lower != "" {
			diskDir = rootfs.OverlayUpperDir(c.inst.l.dir)
		}
		info, ok := disks[absDir(diskDir)]
		if !ok {
			b.log.Warn("oci: reconcile: sandbox on a block root whose disk nobody serves any more; removing it", "id", c.st.ID)
			c.inst = nil
			continue
		}
		c.info = &info
		if c.st.Lower != "" {
			// One at a time: adopting takes a use of a shared lower.
			if err := b.adoptOverlay(c.inst, c.st, lowers, info, mounts); err != nil {
				b.log.Warn("oci: reconcile: cannot adopt overlay root; removing the sandbox", "id", c.st.ID, "err", err)
				c.inst, c.info = nil, nil
			}
			continue
		}
		g.Go(func() error {
			if err := b.adoptBlock(c.inst, info, mounts); err != nil {
				b.log.Warn("oci: reconcile: cannot adopt block root; removing the sandbox", "id", c.st.ID, "err", err)
				c.inst, c.info = nil, nil
			}
			return nil
		})
	}
	_ = g.Wait()
	return cands
}

// removeContainers deletes the runtime state of containers whose processes are already
// killed. Each delete is a runtime invocation; a restart after a burst finds many (warm
// containers, sandboxes not adopted), so they run a few at a time.
func (b *Backend) removeContainers(ctx context.Context, ids []string) error {
	var mu sync.Mutex
	var errs []error
	var g errgroup.Group
	g.SetLimit(8)
	for _, id := range ids {
		g.Go(func() error {
			if err := b.rt.remove(ctx, id); err != nil {
				mu.Lock()
				errs = append(errs, err)
				mu.Unlock()
			}
			return nil
		})
	}
	_ = g.Wait()
	return errors.Join(errs...)
}

func readState(path string) (savedState, error) {
	var st savedState
	raw, err := os.ReadFile(path)
	if err != nil {
		return st, err
	}
	if err := json.Unmarshal(raw, &st); err != nil {
		return st, fmt.Errorf("oci: %s: %w", path, err)
	}
	return st, nil
}

// sweepCgroups kills the processes of, and removes, every cgroup under CgroupParent that
// does not belong to an adopted sandbox (runc normally removes them; a crash of runc itself
// or a lost state dir can leave them behind).
func (b *Backend) sweepCgroups(keep map[string]bool) error {
	var errs []error
	for id := range b.strayCgroups(keep) {
		rel := b.cgroupsPath(id)
		for _, d := range cgroupDirs(rel, b.v2) {
			killCgroupProcs(d)
		}
		var err error
		for range 50 { // killed processes take a moment to leave the cgroup
			if err = removeCgroups(rel, b.v2); err == nil {
				break
			}
			time.Sleep(20 * time.Millisecond)
		}
		errs = append(errs, err)
	}
	return errors.Join(errs...)
}

// strayCgroups lists the cgroups under CgroupParent (by container id) not in keep.
func (b *Backend) strayCgroups(keep map[string]bool) map[string]bool {
	seen := map[string]bool{}
	for _, parent := range cgroupDirs("/"+b.cfg.CgroupParent, b.v2) {
		ents, err := os.ReadDir(parent)
		if err != nil {
			continue
		}
		for _, e := range ents {
			if e.IsDir() && !keep[e.Name()] {
				seen[e.Name()] = true
			}
		}
	}
	return seen
}

// killCgroups sends SIGKILL to every process of the cgroups under CgroupParent not in
// keep, without waiting for them to exit.
func (b *Backend) killCgroups(keep map[string]bool) {
	for id := range b.strayCgroups(keep) {
		for _, d := range cgroupDirs(b.cgroupsPath(id), b.v2) {
			killCgroupProcs(d)
		}
	}
}

func killCgroupProcs(dir string) {
	raw, err := os.ReadFile(filepath.Join(dir, "cgroup.procs"))
	if err != nil {
		return
	}
	// A frozen cgroup would keep killed processes from exiting.
	thaw(dir)
	for _, f := range strings.Fields(string(raw)) {
		if pid, err := strconv.Atoi(f); err == nil && pid > 0 {
			_ = syscall.Kill(pid, syscall.SIGKILL)
		}
	}
}
