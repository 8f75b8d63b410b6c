package oci

import (
	"context"
	"errors"
	"fmt"
	"os"
	"sync"
	"time"

	"github.com/aenv-dev/aenv/internal/network"
	"github.com/aenv-dev/aenv/internal/sandbox"
	"github.com/aenv-dev/aenv/internal/storage/blockdev"
)

// Instance is one container sandbox.
type Instance struct {
	b       *Backend
	id      string // sandbox id
	cid     string // runtime container id: the sandbox id, or a warm container's own id
	l       layout // keyed by cid
	res     sandbox.Resources
	started time.Time
	// allowInternet is the network policy it was launched with (fork children inherit it).
	allowInternet bool
	// running is set on a warm container whose init the pool already started.
	running bool

	// snapMu serializes snapshots (and a pause to disk) of this sandbox.
	snapMu sync.Mutex

	mu      sync.Mutex
	slot    *network.Slot
	idmap   *idMap
	root    diskRoot // a root on sealed layers; nil for an overlay on a directory template
	stopped bool
	lastCPU uint64
	lastAt  time.Time
}

var _ sandbox.Instance = (*Instance)(nil)

// adopt takes over a warm container that was started for this sandbox.
func (i *Instance) adopt(w *Instance) {
	i.mu.Lock()
	defer i.mu.Unlock()
	w.mu.Lock()
	i.cid, i.l, i.slot, i.idmap, i.root = w.cid, w.l, w.slot, w.idmap, w.root
	w.mu.Unlock()
}

func (i *Instance) setSlot(s *network.Slot) {
	i.mu.Lock()
	i.slot = s
	i.mu.Unlock()
}

// ID implements sandbox.Instance.
func (i *Instance) ID() string { return i.id }

// Endpoint implements sandbox.Instance: the slot's address, reachable from the host only.
func (i *Instance) Endpoint() sandbox.Endpoint {
	i.mu.Lock()
	defer i.mu.Unlock()
	if i.slot == nil {
		return sandbox.Endpoint{EnvdPort: i.b.cfg.EnvdPort}
	}
	return sandbox.Endpoint{Host: i.slot.IP.String(), EnvdPort: i.b.cfg.EnvdPort}
}

// InitPID is the host pid of the sandbox's init (envd), or 0.
func (i *Instance) InitPID(ctx context.Context) int {
	st, err := i.b.rt.state(ctx, i.cid)
	if err != nil {
		return 0
	}
	return st.Pid
}

// Status is the runtime's view: running, paused, stopped, or an error wrapping ErrGone.
func (i *Instance) Status(ctx context.Context) (string, error) {
	st, err := i.b.rt.state(ctx, i.cid)
	if errors.Is(err, errNoContainer) {
		return "", fmt.Errorf("%w: %s", sandbox.ErrGone, i.id)
	}
	if err != nil {
		return "", err
	}
	return st.Status, nil
}

func (i *Instance) live() error {
	i.mu.Lock()
	defer i.mu.Unlock()
	if i.stopped {
		return fmt.Errorf("%w: %s was stopped", sandbox.ErrGone, i.id)
	}
	return nil
}

// Pause implements sandbox.Instance. With KeepMemory, or for a sandbox on an overlay root
// (which cannot snapshot), it freezes the cgroup: CPU is released, memory and processes
// stay. Without KeepMemory a sandbox on a block root is paused to disk: snapshot, then
// stop, releasing everything; Launch(LaunchResume) relaunches it from the capture.
func (i *Instance) Pause(ctx context.Context, o sandbox.PauseOptions) (sandbox.PausedState, error) {
	if err := i.live(); err != nil {
		return nil, err
	}
	if !o.KeepMemory && i.isBlock() {
		return i.pauseToDisk(ctx)
	}
	st, err := i.Status(ctx)
	if err != nil {
		return nil, err
	}
	if st != "paused" {
		if st != "running" {
			return nil, fmt.Errorf("%w: %s is %s", sandbox.ErrGone, i.id, st)
		}
		if err := i.b.rt.pause(ctx, i.cid); err != nil {
			return nil, err
		}
	}
	return pausedState{ID: i.id}, nil
}

// Resume implements sandbox.Instance by thawing the cgroup. Resuming a running sandbox is
// a no-op.
func (i *Instance) Resume(ctx context.Context) error {
	if err := i.live(); err != nil {
		return err
	}
	st, err := i.Status(ctx)
	if err != nil {
		return err
	}
	switch st {
	case "running":
		return nil
	case "paused":
		return i.b.rt.resume(ctx, i.cid)
	default:
		return fmt.Errorf("%w: %s is %s", sandbox.ErrGone, i.id, st)
	}
}

// Stop implements sandbox.Instance: kill every process, delete the container and its
// cgroups, unmount the rootfs, release the network slot, remove the bundle. Idempotent;
// each step runs even if an earlier one failed, so nothing is left that can be removed.
func (i *Instance) Stop(ctx context.Context) error {
	// Not in the middle of a snapshot: it would find its root gone under it.
	i.snapMu.Lock()
	defer i.snapMu.Unlock()
	i.mu.Lock()
	slot, blk := i.slot, i.root
	i.slot, i.root = nil, nil
	i.stopped = true
	i.mu.Unlock()
	t0 := time.Now()
	rmErr := i.b.removeContainer(ctx, i.cid, i.l, i.idmap)
	errs := []error{rmErr, removeCgroups(i.b.cgroupsPath(i.cid), i.b.v2)}
	t1 := time.Now()
	if blk != nil && rmErr == nil {
		// Nothing runs on the root any more and its directory, the disk's upper with it,
		// is removed below (a snapshot or pause took what it keeps before this): its
		// unmount's flushes need not wait for the host's disk.
		if err := blk.DropSyncs(); err != nil {
			i.b.log.Debug("oci: drop the root disk's syncs", "id", i.id, "err", err)
		}
	}
	// Only a root stacked on layers of the node's own (sealed by snapshots) can leave
	// some unused: one on template layers alone cannot, and the collection walks every
	// held root's layers (~1 ms of the stop's CPU at 1 500 held).
	collect := blk != nil && onLayersIn(blk.files(), i.b.layersDir())
	if blk != nil {
		// ext4, then the loop device, then FUSE and the stack: each holds the next. A
		// filesystem still held (its mount namespace still being torn down, slow on a
		// loaded host) was detached and frees its device by itself: the sandbox is gone.
		err := blk.Close()
		if errors.Is(err, blockdev.ErrStillInUse) {
			i.b.log.Warn("oci: root disk still held after the stop; it is released when its last user goes", "id", i.id, "err", err)
		}
		errs = append(errs, blockdev.WithoutStillInUse(err))
	}
	errs = append(errs, unmountAll(i.l.dir))
	t2 := time.Now()
	if slot != nil {
		errs = append(errs, i.b.pool.Release(ctx, slot))
	}
	t3 := time.Now()
	if err := os.RemoveAll(i.l.dir); err != nil {
		errs = append(errs, fmt.Errorf("oci: remove bundle: %w", err))
	}
	i.b.log.Debug("oci: container removed", "id", i.id, "cid", i.cid, "runtime", t1.Sub(t0), "rootfs", t2.Sub(t1),
		"network", t3.Sub(t2), "bundle", time.Since(t3))
	i.b.mu.Lock()
	if i.b.instances[i.id] == i {
		delete(i.b.instances, i.id)
	}
	i.b.mu.Unlock()
	if collect {
		// Layers only this root still used (sealed by its snapshots, all discarded) go.
		errs = append(errs, i.b.gcLayers())
	}
	return errors.Join(errs...)
}

// Stats implements sandbox.Instance from the cgroup's counters. CPU use is averaged since
// the previous call (or since start on the first).
func (i *Instance) Stats(ctx context.Context) (sandbox.Stats, error) {
	if err := i.live(); err != nil {
		return sandbox.Stats{}, err
	}
	c, err := readCounters(i.b.cgroupsPath(i.cid), i.b.v2)
	if err != nil {
		if _, serr := i.Status(ctx); errors.Is(serr, sandbox.ErrGone) {
			return sandbox.Stats{}, serr
		}
		return sandbox.Stats{}, err
	}
	now := time.Now()
	i.mu.Lock()
	prevCPU, prevAt := i.lastCPU, i.lastAt
	if prevAt.IsZero() {
		prevAt = i.started
	}
	i.lastCPU, i.lastAt = c.cpuNanos, now
	i.mu.Unlock()
	cpus := i.res.CPUCount
	if cpus <= 0 {
		cpus = 1
	}
	var pct float64
	if el := now.Sub(prevAt); el > 0 && c.cpuNanos >= prevCPU {
		pct = float64(c.cpuNanos-prevCPU) / float64(el.Nanoseconds()) / float64(cpus) * 100
	}
	diskUsed, diskTotal := diskUsage(i.l.upper()), int64(i.res.DiskSizeMB)<<20
	if i.isBlock() {
		diskUsed, diskTotal = fsUsage(i.l.rootfs())
	}
	memTotal := c.memLimit
	if i.res.MemoryMB > 0 && (memTotal <= 0 || memTotal > int64(i.res.MemoryMB)<<20) {
		memTotal = int64(i.res.MemoryMB) << 20
	}
	return sandbox.Stats{
		Timestamp:  now,
		CPUCount:   cpus,
		CPUUsedPct: pct,
		MemUsed:    c.memUsage,
		MemTotal:   memTotal,
		MemCache:   c.memCache,
		DiskUsed:   diskUsed,
		DiskTotal:  diskTotal,
	}, nil
}
