package blockdev

import (
	"context"
	"errors"
	"path/filepath"
)

// Exposed is a device served through FUSE and attached to a loop device:
// the usual way to hand a stack to ext4 or a VMM.
type Exposed struct {
	Mount *Mount
	Loop  *Loop
}

// Expose mounts dev under dir/fuse and attaches a loop device to it, with direct I/O
// unless o.BufferedLoop: a filesystem on the device then has its data cached once (in
// its own page cache), and its flushes (sync, a snapshot's freeze) send dirty data
// straight to the device instead of through a second cache.
func Expose(ctx context.Context, dir string, dev Device, o MountOptions) (*Exposed, error) {
	m, err := MountFile(ctx, filepath.Join(dir, "fuse"), dev, o)
	if err != nil {
		return nil, err
	}
	l, err := AttachLoopWith(ctx, m.Path(), LoopOptions{ReadOnly: o.ReadOnly, DirectIO: !o.BufferedLoop})
	if err != nil {
		return nil, errors.Join(err, m.Close())
	}
	return &Exposed{Mount: m, Loop: l}, nil
}

// Device is the loop device path, e.g. /dev/loop3.
func (e *Exposed) Device() string { return e.Loop.Path() }

// Close detaches the loop device (flushing it) and unmounts FUSE. Anything
// mounted from the loop device must be unmounted first.
func (e *Exposed) Close() error {
	return errors.Join(e.Loop.Detach(), e.Mount.Close())
}
