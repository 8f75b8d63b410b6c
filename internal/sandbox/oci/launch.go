package oci

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"time"

	"github.com/aenv-dev/aenv/internal/sandbox"
	"github.com/aenv-dev/aenv/internal/storage/stack"
	"golang.org/x/sys/unix"
)

// Launch implements sandbox.Backend. Fresh creates a sandbox on the template's layered
// block root when RootFS has Layers, otherwise on an overlay of its directory (from a warm,
// created but not started, container of the same template when one is ready).
// FromSnapshot creates one on a fresh upper over a capture's sealed layers. Resume thaws a
// sandbox paused in place, or relaunches one paused to disk from its capture.
func (b *Backend) Launch(ctx context.Context, plan sandbox.LaunchPlan) (sandbox.Instance, error) {
	if !idRE.MatchString(plan.SandboxID) {
		return nil, fmt.Errorf("oci: invalid sandbox id %q", plan.SandboxID)
	}
	if plan.Resources.CPUCount < 0 || plan.Resources.MemoryMB < 0 || plan.Resources.DiskSizeMB < 0 {
		return nil, fmt.Errorf("oci: negative resources %+v", plan.Resources)
	}
	switch plan.Kind {
	case sandbox.LaunchFresh:
		if len(plan.RootFS.Layers) > 0 {
			return b.launchBlock(ctx, plan, layerRefs(plan.RootFS.Layers), nil, plan.RootFS.VirtualSize)
		}
	case sandbox.LaunchResume:
		return b.resume(ctx, plan)
	case sandbox.LaunchFromSnapshot:
		c, ok := plan.Snapshot.(*Captured)
		if !ok || c == nil {
			return nil, fmt.Errorf("oci: launch from snapshot: capture is %T, not this backend's", plan.Snapshot)
		}
		return b.launchBlock(ctx, plan, c.Layers, fromUpperRefs(c.Upper), c.VirtualSize)
	default:
		return nil, fmt.Errorf("oci: unknown launch kind %d", plan.Kind)
	}
	if plan.RootFS.LowerDir == "" {
		return nil, errors.New("oci: launch plan has no RootFS.LowerDir")
	}
	if fi, err := os.Stat(plan.RootFS.LowerDir); err != nil || !fi.IsDir() {
		return nil, fmt.Errorf("oci: template rootfs %q is not a directory: %v", plan.RootFS.LowerDir, err)
	}
	inst, err := b.reserve(plan)
	if err != nil {
		return nil, err
	}

	return b.launchWarmOrNew(ctx, inst, plan, plan.RootFS.LowerDir, createOpts{lower: plan.RootFS.LowerDir})
}

// launchWarmOrNew starts the reserved inst from a warm container of root (key names it)
// when one is ready, else, for a block root, from a blank warm container (reroot.go), else
// creates one; either way the pool learns what was in demand. key "" is a root launched
// once (a fork's child, a resume from disk): it has no pool of its own.
func (b *Backend) launchWarmOrNew(ctx context.Context, inst *Instance, plan sandbox.LaunchPlan, key string, root createOpts) (sandbox.Instance, error) {
	if len(plan.Mounts) > 0 {
		// A warm container's spec is written before anyone asks: it has no volumes.
		return b.launchNew(ctx, inst, plan, root)
	}
	defer b.warm.begin()()
	if key != "" {
		w := b.warm.take(key)
		b.warm.want(key, root)
		if w != nil && b.claim(ctx, inst, w, func() error { return b.startWarm(ctx, w, plan) }) {
			return inst, nil
		}
	}
	if len(root.layers) > 0 && b.blankRoot != "" {
		w := b.warm.take(blankKey)
		b.warm.want(blankKey, createOpts{blank: true})
		if w != nil && b.claim(ctx, inst, w, func() error { return b.startBlank(ctx, w, plan, root) }) {
			return inst, nil
		}
	}
	return b.launchNew(ctx, inst, plan, root)
}

// claim makes warm container w the reserved inst with start; false (w stopped) when
// start failed.
func (b *Backend) claim(ctx context.Context, inst, w *Instance, start func() error) bool {
	err := start()
	if err == nil {
		inst.adopt(w)
		return true
	}
	b.log.Warn("oci: warm container failed; creating a fresh one", "id", inst.id, "cid", w.cid, "err", err)
	if cerr := w.Stop(context.WithoutCancel(ctx)); cerr != nil {
		b.log.Warn("oci: cleanup of a failed warm container", "cid", w.cid, "err", cerr)
	}
	return false
}

// reserve registers a new instance under plan.SandboxID, or fails if the id is taken.
func (b *Backend) reserve(plan sandbox.LaunchPlan) (*Instance, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	if _, ok := b.instances[plan.SandboxID]; ok {
		return nil, fmt.Errorf("%w: %s", ErrExists, plan.SandboxID)
	}
	inst := &Instance{b: b, id: plan.SandboxID, res: plan.Resources, started: time.Now(), allowInternet: plan.AllowInternet}
	b.instances[plan.SandboxID] = inst // reserves the id
	return inst, nil
}

// launchNew creates and starts a container for the reserved inst with a bundle of its own;
// o names the root (the rest of o comes from plan). On failure nothing is left behind.
func (b *Backend) launchNew(ctx context.Context, inst *Instance, plan sandbox.LaunchPlan, o createOpts) (sandbox.Instance, error) {
	inst.cid = b.containerID(plan.SandboxID)
	inst.l = b.layout(inst.cid)
	o.allowInternet, o.res, o.hostname, o.run = plan.AllowInternet, plan.Resources, sandbox.Hostname(plan.SandboxID), true
	o.mounts = plan.Mounts
	err := os.Mkdir(inst.l.dir, 0o711)
	if err == nil {
		err = b.create(ctx, inst, o)
	} else if errors.Is(err, os.ErrExist) {
		// A bundle nobody tracks (Reconcile not run yet?): leave it alone.
		b.mu.Lock()
		delete(b.instances, plan.SandboxID)
		b.mu.Unlock()
		return nil, fmt.Errorf("%w: %s has a bundle on disk", ErrExists, inst.cid)
	}
	if err != nil {
		// Clean with a fresh context: a cancelled launch must still leave nothing behind.
		if cerr := inst.Stop(context.WithoutCancel(ctx)); cerr != nil {
			b.log.Warn("oci: cleanup after failed launch", "id", plan.SandboxID, "err", cerr)
		}
		return nil, err
	}
	return inst, nil
}

// createOpts describes one container to create.
type createOpts struct {
	lower         string
	layers        []stack.LayerRef // a root on layers instead of an overlay on lower
	upper         []stack.LayerRef // an overlay root's upper layers over layers (sharedlower.go)
	flat          bool             // a block root on layers even with Config.OverlayRoots (LaunchPlan.FlatRoot)
	vsize         uint64           // the block root's device size; 0 = the layers'
	allowInternet bool
	res           sandbox.Resources
	hostname      string
	run           bool // start the init once created, or leave it created (warm pool)
	mounts        []sandbox.Mount
	// blank creates the container on the backend's blank root, with no root of its own
	// (a blank warm container, see reroot.go); lower and layers are unused.
	blank bool
}

// rootOnly is o without what belongs to one sandbox rather than to its root: what a warm
// pool keeps to make more containers of the same root. Every field that names the root
// stays (an overlay root's upper layers among them: without them a snapshot template's
// warm containers came up on an empty upper).
func (o createOpts) rootOnly() createOpts {
	return createOpts{lower: o.lower, layers: o.layers, upper: o.upper, flat: o.flat, vsize: o.vsize, blank: o.blank}
}

// create builds a container for inst (whose cid and bundle dir are set): network slot,
// user namespace, overlay rootfs, config.json, then `run -d` or `create`.
func (b *Backend) create(ctx context.Context, inst *Instance, o createOpts) error {
	t0 := time.Now()
	slot, err := b.pool.Acquire(ctx, o.allowInternet)
	if err != nil {
		return fmt.Errorf("oci: network slot: %w", err)
	}
	inst.setSlot(slot)
	var m *idMap
	userns := -1
	if b.userns && slot.Index >= b.cfg.UIDRanges {
		return fmt.Errorf("oci: network slot %d has no uid range: the node reserved %d (backend.uid_ranges), "+
			"the most sandboxes it holds at once", slot.Index, b.cfg.UIDRanges)
	}
	if b.userns {
		m = &idMap{HostID: b.cfg.UIDBase + uint32(slot.Index)*idRangeSize, Size: idRangeSize}
	}
	if m != nil && !o.blank {
		if userns, err = b.usernsFDs.get(*m); err != nil {
			return err
		}
		// Only the id-mapped mounts below use it (a blank container has none: its root is
		// mapped when it is moved onto one, with its own namespace); the container's own
		// namespace, with the same mapping, is kept when it stops (usernsCache.keeper).
		defer unix.Close(userns)
	}
	inst.idmap = m
	if err := b.saveState(inst, o.lower, len(o.layers) > 0, o.allowInternet); err != nil {
		return err
	}
	t1 := time.Now()
	rootPath := inst.l.rootfs()
	if o.blank {
		rootPath = b.blankRoot
	} else if len(o.layers) > 0 {
		if err := b.mountBlock(ctx, inst, o, userns); err != nil {
			return err
		}
		if o.overlay(b.cfg.OverlayRoots) {
			// Where its shared lower is, which only the mount knew.
			if err := b.saveState(inst, o.lower, true, o.allowInternet); err != nil {
				return err
			}
		}
	} else if err := mountRootfs(inst.l, o.lower, m, userns); err != nil {
		return err
	}
	vols, err := volumeMounts(inst.l, o.mounts, userns)
	if err != nil {
		return err
	}
	t2 := time.Now()
	spec := buildSpec(specParams{
		rootfs: rootPath, hostname: o.hostname, netnsPath: slot.NetnsPath,
		envdPath: b.cfg.EnvdPath, args: b.initArgs(),
		env: []string{
			"PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
			"HOME=/root", "E2B_SANDBOX=true", "AENV_ENVD_PORT=" + strconv.Itoa(b.cfg.EnvdPort),
			// envd's own Go runtime (the processes it starts do not inherit envd's
			// environment): one P, so fewer threads and per-P caches in every idle
			// sandbox (~0.35 MiB less than two); envd's work is I/O. Set here rather
			// than by envd at start, which would come after the runtime made the Ps.
			"GOMAXPROCS=1",
		},
		cgroupsPath: b.cgroupsPath(inst.cid), cpuCount: o.res.CPUCount,
		memoryMB: o.res.MemoryMB, pidsLimit: b.cfg.PidsLimit, idmap: m, memsw: b.memsw,
		resolvConf: b.cfg.ResolvConf, volumes: vols,
		emptyDir: b.emptyDir, maskDirs: bindMaskedDirs(b.rt), cgroupBinds: b.viewCgroups(b.rt),
		cgroupViewDir: b.cgroupViewDir,
	})
	if err := writeJSON(filepath.Join(inst.l.dir, "config.json"), spec); err != nil {
		return err
	}
	if err := b.rt.create(ctx, inst.cid, inst.l.dir, slot.NetnsPath, inst.l.pid(), inst.l.log()); err != nil {
		return err
	}
	if b.bootIDs {
		pid, err := readPid(inst.l.pid())
		if err != nil {
			return err
		}
		if err := bindBootID(pid, m.rootID()); err != nil {
			return err
		}
	}
	if o.run {
		if err := b.rt.start(ctx, inst.cid); err != nil {
			return err
		}
	}
	b.log.Debug("oci: container created", "id", inst.id, "cid", inst.cid, "slot", slot.Index, "started", o.run,
		"network", t1.Sub(t0), "rootfs", t2.Sub(t1), "runtime", time.Since(t2))
	return nil
}

// saveState records what Reconcile needs to adopt the container after a restart.
func (b *Backend) saveState(inst *Instance, lower string, block, allowInternet bool) error {
	st := savedState{
		ID: inst.id, ContainerID: inst.cid, LowerDir: lower, Block: block, Resources: inst.res,
		SlotIndex: inst.slot.Index, AllowInternet: allowInternet, IDMap: inst.idmap, Created: inst.started,
	}
	inst.mu.Lock()
	if r, ok := inst.root.(overlayRoot); ok {
		st.Lower, st.LowerLayers = r.Lower().Path(), r.lower
	}
	inst.mu.Unlock()
	tmp := inst.l.state() + ".tmp"
	if err := writeJSON(tmp, st); err != nil {
		return err
	}
	if err := os.Rename(tmp, inst.l.state()); err != nil {
		return fmt.Errorf("oci: save state: %w", err)
	}
	return nil
}

func (b *Backend) initArgs() []string {
	if len(b.cfg.InitArgs) > 0 {
		return b.cfg.InitArgs
	}
	args := b.cfg.EnvdArgs
	if args == nil {
		args = containerEnvdArgs()
	}
	return append([]string{envdMount}, args...)
}

// containerEnvdArgs tune envd's Go runtime for a node holding thousands of idle sandboxes,
// each with an envd of its own (docs/operations.md, "Density and host limits"): collect
// only when there is something to collect (an idle envd that never ran a collection keeps
// ~1.1 MiB less resident) and trim only after a burst that left at least 1 MiB of garbage;
// take no signal, as the node ends a container with SIGKILL: Go's signal delivery keeps
// three of an idle envd's six threads (pivot_root and other kernel walks visit every thread
// on the host, and each costs memory). envd's GOMAXPROCS is set in its environment (see create).
func containerEnvdArgs() []string {
	return []string{"-gc-limit-mb", "16", "-idle-trim-min-kb", "1024", "-forward-signals=false"}
}
