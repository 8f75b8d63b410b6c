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
	"syscall"
	"time"

	"github.com/aenv-dev/aenv/internal/rootfs"
	"github.com/aenv-dev/aenv/internal/sandbox"
)

// Reconcile implements sandbox.Backend. It adopts the containers of known ids that are
// still running or paused and removes everything else this backend owns: other containers
// in its runtime root, bundle directories and their mounts, loop devices and FUSE mounts
// of block roots, cgroups under CgroupParent, network slots, and layer files no capture
// record lists. Call it once at startup, before Launch.
//
// Sandboxes on block roots are never adopted: their FUSE server lived in the previous
// process, so their root filesystem is gone. They are removed (a sandbox paused to disk
// is not affected: it has no container, only its capture).
func (b *Backend) Reconcile(ctx context.Context, known []string) (map[string]sandbox.Instance, error) {
	want := map[string]bool{}
	for _, id := range known {
		want[id] = true
	}
	containers, err := b.rt.list(ctx)
	if err != nil {
		return nil, err
	}
	var errs []error
	adopt := map[string]*Instance{}   // by sandbox id
	states := map[string]savedState{} // by sandbox id
	cids := map[string]bool{}         // container ids of adopted sandboxes
	var stale []string                // containers to delete
	for _, c := range containers {
		if c.Status == "running" || c.Status == "paused" {
			l := b.layout(c.ID)
			st, err := readState(l.state())
			if st.ContainerID == "" {
				st.ContainerID = st.ID
			}
			if err == nil && st.ID != "" && want[st.ID] && st.ContainerID == c.ID && adopt[st.ID] == nil && !st.Block {
				adopt[st.ID] = &Instance{b: b, id: st.ID, cid: c.ID, l: l, res: st.Resources, started: st.Created, idmap: st.IDMap}
				states[st.ID] = st
				cids[c.ID] = true
				continue
			}
		}
		// Unknown, dead, or a warm container of the previous run (never started).
		stale = append(stale, c.ID)
	}
	// Kill every process of what is not adopted before the sweep below unmounts roots
	// under them: SIGKILL is queued even to a process stuck on a block root whose FUSE
	// server died, and takes effect once the sweep aborts the connection.
	b.killCgroups(cids)
	// Block roots first (FUSE connections aborted, then ext4 mounts, loop devices, FUSE
	// mounts): the adopted sandboxes all have overlay roots, which this leaves alone.
	errs = append(errs, rootfs.Sweep(ctx, filepath.Join(b.cfg.DataDir, "sandboxes")))
	for _, id := range stale {
		if err := b.rt.remove(ctx, id); err != nil {
			errs = append(errs, err)
		}
	}
	// Bundles without an adopted container: a crash between mount and run, or after the
	// container died.
	ents, err := os.ReadDir(filepath.Join(b.cfg.DataDir, "sandboxes"))
	if err != nil {
		return nil, fmt.Errorf("oci: list bundles: %w", err)
	}
	for _, e := range ents {
		if cids[e.Name()] {
			continue
		}
		l := b.layout(e.Name())
		errs = append(errs, unmountAll(l.dir), os.RemoveAll(l.dir))
	}
	errs = append(errs, b.sweepCgroups(cids))

	keep := map[int]bool{}
	for _, st := range states {
		keep[st.SlotIndex] = st.AllowInternet
	}
	slots, err := b.pool.Reconcile(ctx, keep)
	errs = append(errs, err)

	alive := map[string]sandbox.Instance{}
	for id, inst := range adopt {
		slot := slots[states[id].SlotIndex]
		if slot == nil {
			// Its network namespace is gone: the sandbox is unreachable, remove it.
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
	return alive, errors.Join(errs...)
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
