package rootfs

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"

	"github.com/aenv-dev/aenv/internal/storage/blockdev"
	"github.com/aenv-dev/aenv/internal/storage/stack"
)

// Names inside Spec.Dir, as dataplane.Disk uses them.
const (
	upperData  = "upper.data"
	upperIndex = "upper.index"
	exposeDir  = "blk" // FUSE mount point lives at blk/fuse
)

// Disk is a layered root served as a plain file through FUSE, with no loop device and no
// host mount: what a VMM opens as a guest's block device (the guest mounts the ext4
// filesystem itself). Close releases it; the upper's files stay in the spec's Dir.
type Disk struct {
	st *stack.Stack
	m  *blockdev.Mount
}

// OpenDisk opens the stack of spec (Dir, Lowers, VirtualSize, Resolver; the other fields
// are ignored), creating an empty upper in spec.Dir, grows its filesystem to the device
// size like Open does, and serves it as a file under spec.Dir. On error nothing stays
// mounted.
func OpenDisk(ctx context.Context, spec Spec) (d *Disk, err error) {
	if len(spec.Lowers) == 0 {
		return nil, errors.New("rootfs: no lowers")
	}
	if spec.VirtualSize%512 != 0 {
		spec.VirtualSize = (spec.VirtualSize + 511) / 512 * 512
	}
	if err := os.MkdirAll(spec.Dir, 0o711); err != nil {
		return nil, fmt.Errorf("rootfs: %w", err)
	}
	m := &stack.Manifest{
		Dir:         spec.Dir,
		VirtualSize: spec.VirtualSize,
		Lowers:      append([]stack.LayerRef(nil), spec.Lowers...),
		Upper:       &stack.Upper{Data: upperData, Index: upperIndex},
	}
	st, err := stack.Open(ctx, m, stack.Options{Resolver: spec.Resolver})
	if err != nil {
		return nil, fmt.Errorf("rootfs: open stack: %w", err)
	}
	d = &Disk{st: st}
	defer func() {
		if err != nil {
			err = errors.Join(err, d.Close())
		}
	}()
	fsSize, err := ext4Size(st)
	if err != nil {
		return d, err
	}
	if d.m, err = blockdev.MountFile(ctx, filepath.Join(spec.Dir, exposeDir, "fuse"), st, blockdev.MountOptions{}); err != nil {
		return d, fmt.Errorf("rootfs: expose: %w", err)
	}
	// resize2fs works on the file as well as on a device.
	if uint64(st.Size()) >= fsSize+1<<20 {
		if err := grow(ctx, d.m.Path()); err != nil {
			return d, err
		}
	}
	return d, nil
}

// Path is the disk file a VMM opens (raw format).
func (d *Disk) Path() string { return d.m.Path() }

// Size is the disk's size in bytes.
func (d *Disk) Size() int64 { return d.st.Size() }

// Lowers returns the stack's current sealed layers, bottom first.
func (d *Disk) Lowers() []stack.LayerRef { return d.st.Manifest().Lowers }

// Stack is the layer stack behind the file, for snapshots (seal and restack while the
// VMM that writes the file is stopped).
func (d *Disk) Stack() *stack.Stack { return d.st }

// Close unmounts the file and closes the stack; idempotent. The VMM must have closed the
// file (exited) first, or the unmount is lazy and Close reports it.
func (d *Disk) Close() error {
	var errs []error
	if d.m != nil {
		errs = append(errs, d.m.Close())
		d.m = nil
	}
	if d.st != nil {
		errs = append(errs, d.st.Close())
		d.st = nil
	}
	return errors.Join(errs...)
}
