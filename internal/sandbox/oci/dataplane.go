package oci

import (
	"context"
	"errors"
	"path/filepath"

	"github.com/aenv-dev/aenv/internal/dataplane"
	"github.com/aenv-dev/aenv/internal/rootfs"
	"github.com/aenv-dev/aenv/internal/storage/blockdev"
)

// Layered roots served by the data plane (Config.DataPlane) outlive this process: the
// FUSE file behind a root's loop device is served by `aenv dataplane`, and the loop device,
// the ext4 mount and the container are kernel objects. Reconcile lists the data plane's
// disks and adopts the running sandboxes whose roots it still serves; it closes the
// other disks after sweeping their mounts.

// DataPlane is the client of the data plane the backend opens layered roots through.
type DataPlane interface {
	Open(ctx context.Context, spec dataplane.Spec) (*dataplane.RemoteDisk, error)
	List(ctx context.Context) ([]dataplane.Info, error)
	Attach(info dataplane.Info) *dataplane.RemoteDisk
	Close(ctx context.Context, dir string) error
}

// diskOpener is how mountBlock serves a root: through the data plane when configured,
// else in this process (rootfs's default).
func (b *Backend) diskOpener() rootfs.Opener {
	return rootfs.RemoteOpener(b.cfg.DataPlane) // a nil DataPlane converts to a nil DiskServer
}

// dataPlaneDisks lists the data plane's disks by directory; nil without a data plane.
func (b *Backend) dataPlaneDisks(ctx context.Context) (map[string]dataplane.Info, error) {
	if b.cfg.DataPlane == nil {
		return nil, nil
	}
	list, err := b.cfg.DataPlane.List(ctx)
	if err != nil {
		return nil, err
	}
	out := make(map[string]dataplane.Info, len(list))
	for _, d := range list {
		out[d.Dir] = d
	}
	return out, nil
}

// adoptBlock takes over the block root of a running container from the data plane's
// disk info.
func (b *Backend) adoptBlock(inst *Instance, info dataplane.Info, mounts blockdev.Mounts) error {
	blk, err := rootfs.Adopt(b.cfg.DataPlane.Attach(info), inst.l.rootfs(), mounts)
	if err != nil {
		return err
	}
	inst.root = blockRoot{blk}
	return nil
}

// closeDisks asks the data plane to stop serving the disks in dirs (their mounts and loop
// devices are gone: the sweep removed them).
func (b *Backend) closeDisks(ctx context.Context, dirs []string) error {
	var errs []error
	for _, d := range dirs {
		if err := b.cfg.DataPlane.Close(ctx, d); err != nil && !errors.Is(err, dataplane.ErrNotFound) {
			errs = append(errs, err)
			continue
		}
		b.log.Info("oci: reconcile: closed a disk of a sandbox that is gone", "dir", d)
	}
	return errors.Join(errs...)
}

// OnDataPlane lists the sandboxes whose root disks the data plane serves: those a crash
// of the data plane takes down.
func (b *Backend) OnDataPlane() []string {
	b.mu.Lock()
	defer b.mu.Unlock()
	var ids []string
	for id, inst := range b.instances {
		inst.mu.Lock()
		if inst.root != nil && inst.root.OutOfProcess() {
			ids = append(ids, id)
		}
		inst.mu.Unlock()
	}
	return ids
}

// DataPlaneLost drops the warm containers on layered roots: their disks died with the
// data plane (OnDataPlane lists the sandboxes that did).
func (b *Backend) DataPlaneLost(ctx context.Context) error {
	// The shared lowers' disks died too: new roots mount their layers anew.
	if b.lowers != nil {
		b.lowers.Forget()
	}
	if b.warm == nil {
		return nil
	}
	return b.warm.forget(ctx, func(o createOpts) bool { return len(o.layers) > 0 })
}

func absDir(p string) string {
	if a, err := filepath.Abs(p); err == nil {
		return a
	}
	return p
}

// reportBlocked logs the threads in state D that wait on FUSE, as found before the sweep
// and still after it: the sweep aborts the connections of servers that are gone, so a
// thread that stays blocked waits on something that is not this node's.
func (b *Backend) reportBlocked(before []blockdev.Task) {
	if len(before) == 0 {
		return
	}
	after := map[int]blockdev.Task{}
	for _, t := range blockdev.BlockedOnFUSE() {
		after[t.TID] = t
	}
	for _, t := range before {
		if _, still := after[t.TID]; still {
			b.log.Warn("oci: reconcile: a thread is still blocked after the sweep", "task", t.String())
		} else {
			b.log.Info("oci: reconcile: a thread blocked at start was released by the sweep", "task", t.String())
		}
	}
}
