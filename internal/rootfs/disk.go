package rootfs

import (
	"context"
	"errors"
	"fmt"
	"path/filepath"
	"time"

	"github.com/aenv-dev/aenv/internal/dataplane"
	"github.com/aenv-dev/aenv/internal/storage/stack"
)

// Disk is a layered root served as a plain file, with no loop device and no host mount:
// what a VMM opens as a guest's block device (the guest mounts the ext4 filesystem
// itself). It is served in this process or by the data plane (Spec.Open), which keeps
// serving it when this process dies; AdoptDisk takes such a disk over after a restart.
// Close releases it; the upper's files stay in the spec's Dir.
type Disk struct {
	d ServedDisk
}

// OpenDisk opens the stack of spec (Dir, Lowers, VirtualSize, Resolver, Open, MaxDirty;
// the other fields are ignored), creating an empty upper in spec.Dir, grows its
// filesystem to the device size like Open does, and serves it as a file under spec.Dir.
// On error nothing stays mounted or served.
func OpenDisk(ctx context.Context, spec Spec) (d *Disk, err error) {
	if len(spec.Lowers) == 0 {
		return nil, errors.New("rootfs: no lowers")
	}
	if spec.VirtualSize%512 != 0 {
		spec.VirtualSize = (spec.VirtualSize + 511) / 512 * 512
	}
	dir, err := filepath.Abs(spec.Dir)
	if err != nil {
		return nil, fmt.Errorf("rootfs: %w", err)
	}
	ds := dataplane.Spec{Dir: dir, Lowers: append([]stack.LayerRef(nil), spec.Lowers...), VirtualSize: spec.VirtualSize, MaxDirty: spec.MaxDirty}
	open := spec.Open
	if open == nil || !allPaths(spec.Lowers) {
		local := dataplane.Local{Resolver: spec.Resolver}
		open = func(ctx context.Context, s dataplane.Spec) (ServedDisk, error) { return local.OpenDisk(ctx, s) }
	}
	sd, err := open(ctx, ds)
	if err != nil {
		return nil, fmt.Errorf("rootfs: open stack: %w", err)
	}
	d = &Disk{d: sd}
	defer func() {
		if err != nil {
			err = errors.Join(err, d.Close())
		}
	}()
	fsSize, err := ext4SizeOfFile(sd.Path())
	if err != nil {
		return d, err
	}
	// resize2fs works on the file as well as on a device.
	if uint64(sd.Size()) >= fsSize+1<<20 {
		if err := grow(ctx, sd.Path()); err != nil {
			return d, err
		}
	}
	return d, nil
}

// AdoptDisk takes over a disk a previous process opened through the data plane and whose
// VMM still runs on it.
func AdoptDisk(sd ServedDisk) *Disk { return &Disk{d: sd} }

// Path is the disk file a VMM opens (raw format).
func (d *Disk) Path() string { return d.d.Path() }

// Dir is the disk's directory (its name in the data plane).
func (d *Disk) Dir() string { return d.d.Dir() }

// Size is the disk's size in bytes.
func (d *Disk) Size() int64 { return d.d.Size() }

// Lowers returns the stack's current sealed layers, bottom first.
func (d *Disk) Lowers() []stack.LayerRef { return d.d.Lowers() }

// OutOfProcess reports whether the data plane serves the disk (it survives this process).
func (d *Disk) OutOfProcess() bool {
	_, ok := d.d.(*dataplane.RemoteDisk)
	return ok
}

// Seal seals the disk's upper into a new lower at output (which must not exist and must
// be on the filesystem of the disk's Dir) and opens a fresh upper. The VMM writing the
// file must be stopped with its writes flushed (a stopped QEMU has flushed its drives).
// It returns every lower, bottom first (the new one last, or a compaction holding it),
// once durable. A failure after the seal leaves the stack broken (stack.ErrBroken).
//
// Served by the data plane, a seal whose caller dies midway is still finished there: the
// new lower is then part of the running disk whether or not the caller registered it.
func (d *Disk) Seal(ctx context.Context, output string) ([]stack.LayerRef, time.Duration, error) {
	snap, err := d.d.BeginSnapshot(ctx)
	if err != nil {
		return nil, 0, fmt.Errorf("rootfs: seal: %w", err)
	}
	defer snap.End()
	if err := snap.Quiet(ctx); err != nil {
		return nil, 0, fmt.Errorf("rootfs: seal: %w", err)
	}
	if _, err := snap.Seal(ctx, output); err != nil {
		return nil, 0, fmt.Errorf("rootfs: seal: %w", err)
	}
	lowers, durable, err := snap.Finish(context.WithoutCancel(ctx))
	if err != nil {
		return nil, durable, fmt.Errorf("rootfs: seal: %w", err)
	}
	return lowers, durable, nil
}

// Close stops serving the disk; idempotent. The VMM must have closed the file (exited)
// first, or the unmount is lazy and Close reports it.
func (d *Disk) Close() error {
	if d.d == nil {
		return nil
	}
	err := d.d.Close()
	if err == nil {
		d.d = nil
	}
	return err
}
