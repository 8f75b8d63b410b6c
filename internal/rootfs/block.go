// Package rootfs gives a sandbox a root filesystem on a layered block device: the sealed
// lowers of a template or snapshot (shared, read-only) plus a writable upper of its own,
// served through FUSE, attached to a loop device and mounted as ext4, optionally
// id-mapped for a user namespace. It also takes consistent live snapshots of such a root
// (freeze, seal the upper into a new lower, thaw) and sweeps what a crash left behind.
//
// Nothing here copies layer data: a launch opens layer files and creates an empty upper,
// and a snapshot appends the upper's index and renames it.
package rootfs

import (
	"bytes"
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"unsafe"

	"github.com/aenv-dev/aenv/internal/dataplane"
	"github.com/aenv-dev/aenv/internal/storage/blockdev"
	"github.com/aenv-dev/aenv/internal/storage/stack"
	"golang.org/x/sys/unix"
)

// ErrNotExt4 means the stack does not hold an ext4 filesystem.
var ErrNotExt4 = errors.New("rootfs: device holds no ext4 filesystem")

// ServedDisk is a layer stack served as a file: in this process (dataplane.Local) or by
// the data-plane daemon (dataplane.Client), which keeps serving it when this process dies.
type ServedDisk interface {
	Dir() string
	Path() string
	Size() int64
	Lowers() []stack.LayerRef
	BeginSnapshot(ctx context.Context) (dataplane.Snapshot, error)
	// DropSyncs stops making the disk's writes durable, for good: its directory is
	// deleted once it closes (see stack.Stack.DropSyncs).
	DropSyncs() error
	Close() error
}

var (
	_ ServedDisk = (*dataplane.Disk)(nil)
	_ ServedDisk = (*dataplane.RemoteDisk)(nil)
)

// Opener opens a disk for a root.
type Opener func(ctx context.Context, spec dataplane.Spec) (ServedDisk, error)

// DiskServer serves disks in another process: the data plane's client.
type DiskServer interface {
	Open(ctx context.Context, spec dataplane.Spec) (*dataplane.RemoteDisk, error)
}

// RemoteOpener opens disks through s; with s nil it returns nil, the in-process default.
func RemoteOpener(s DiskServer) Opener {
	if s == nil {
		return nil
	}
	return func(ctx context.Context, spec dataplane.Spec) (ServedDisk, error) {
		d, err := s.Open(ctx, spec)
		if err != nil {
			return nil, err
		}
		return d, nil
	}
}

// Spec describes one block root.
type Spec struct {
	// Dir is private to this root: it holds the writable upper and the FUSE mount point.
	// It must be on the same filesystem as the directories snapshots are sealed into.
	Dir string
	// Lowers are the sealed layers, bottom first; paths are absolute.
	Lowers []stack.LayerRef
	// VirtualSize is the device size in bytes; 0 keeps the lowers' size. A size larger
	// than the filesystem's grows it (resize2fs before the mount); a smaller one is ignored
	// (shrinking would need a full fsck and could fail).
	VirtualSize uint64
	// Target is where the ext4 filesystem is mounted (created if missing).
	Target string
	// UserNS is an fd of the user namespace the mount is id-mapped to (files owned by
	// host id 0 appear owned by that namespace's root), or -1 for a plain mount.
	UserNS int
	// Resolver opens lowers that have no path; optional. Such a root is always served in
	// this process.
	Resolver stack.Resolver
	// Open serves the disk; nil (and any root with a lower that has no path) serves it
	// in this process.
	Open Opener
	// ReadOnly mounts the filesystem read-only: a shared lower (see Lowers), which only
	// ever reads what the sealed layers hold.
	ReadOnly bool
	// MaxDirty caps the page cache the root may hold dirty (bytes; 0 = DefaultMaxDirty),
	// and with it what a snapshot has to flush; the upper's unsynced growth on the host
	// stays within 4*MaxDirty.
	MaxDirty uint64
}

// Block is a mounted block root. Close releases it; the upper's files stay in Dir.
type Block struct {
	dir     string
	disk    ServedDisk
	loop    *blockdev.Loop
	target  string
	log     *slog.Logger
	undirty func() error // restores the loop device's dirty limits
}

// Open serves the stack (creating an empty upper in spec.Dir), attaches a loop device to
// it and mounts it at spec.Target. On error nothing stays mounted, attached or served.
func Open(ctx context.Context, spec Spec) (b *Block, err error) {
	if len(spec.Lowers) == 0 {
		return nil, errors.New("rootfs: no lowers")
	}
	if spec.VirtualSize%512 != 0 {
		spec.VirtualSize = (spec.VirtualSize + 511) / 512 * 512
	}
	if spec.MaxDirty == 0 {
		spec.MaxDirty = DefaultMaxDirty
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
	disk, err := open(ctx, ds)
	if err != nil {
		return nil, fmt.Errorf("rootfs: open stack: %w", err)
	}
	b = &Block{dir: dir, disk: disk, target: spec.Target, log: slog.Default()}
	defer func() {
		if err != nil {
			err = errors.Join(err, b.Close())
		}
	}()
	fsSize, err := ext4SizeOfFile(disk.Path())
	if err != nil {
		return b, err
	}
	// Named for the disk's directory: its file may be one of a shared mount elsewhere, and
	// a sweep of the sandboxes recognises the device by the name (see SweepLoops).
	b.loop, err = blockdev.AttachLoopWith(ctx, disk.Path(), blockdev.LoopOptions{DirectIO: true, Name: filepath.Join(dir, "disk")})
	if err != nil {
		return b, fmt.Errorf("rootfs: expose: %w", err)
	}
	if b.undirty, err = limitDirty(b.loop.Path(), spec.MaxDirty); err != nil {
		// Only snapshot latency suffers (it then grows with unflushed data).
		b.log.Warn("rootfs: no dirty page limit", "dev", b.loop.Path(), "err", err)
		err = nil
	}
	// Grow only by whole megabytes: rounding differences are not worth a resize2fs.
	if uint64(disk.Size()) >= fsSize+1<<20 {
		if err := grow(ctx, b.loop.Path()); err != nil {
			return b, err
		}
	}
	if err := os.MkdirAll(spec.Target, 0o755); err != nil {
		return b, fmt.Errorf("rootfs: %w", err)
	}
	if err := mountExt4(b.loop.Path(), spec.Target, spec.UserNS, spec.ReadOnly); err != nil {
		return b, err
	}
	// The mount holds the device now; this process's descriptor would only be copied
	// into every child it starts (see blockdev.HeldLoop).
	b.loop.Release()
	b.loop = blockdev.HeldLoop(b.loop.Path())
	return b, nil
}

func allPaths(ls []stack.LayerRef) bool {
	for _, l := range ls {
		if l.Path == "" {
			return false
		}
	}
	return true
}

// Adopt takes over a root a previous process opened and that still runs: disk is served
// by the data plane, its file is attached to a loop device and the filesystem is mounted
// at target (in mounts, the mount table read once for every root adopted). A filesystem
// left frozen (the previous process died in a snapshot) is thawed.
func Adopt(disk ServedDisk, target string, mounts blockdev.Mounts) (*Block, error) {
	dev, err := mounts.Device(target)
	if err != nil {
		return nil, fmt.Errorf("rootfs: adopt %s: %w", target, err)
	}
	backing, err := blockdev.LoopBacking(dev)
	if err != nil {
		return nil, fmt.Errorf("rootfs: adopt %s: %w", target, err)
	}
	if backing != disk.Path() {
		return nil, fmt.Errorf("rootfs: adopt %s: %s is backed by %q, not the disk's %s", target, dev, backing, disk.Path())
	}
	loop := blockdev.HeldLoop(dev)
	if err := blockdev.Thaw(target); err != nil {
		return nil, fmt.Errorf("rootfs: adopt %s: %w", target, err)
	}
	b := &Block{dir: disk.Dir(), disk: disk, loop: loop, target: target, log: slog.Default()}
	if bdi, err := bdiDir(dev); err == nil {
		b.undirty = func() error { return resetDirty(bdi) }
	}
	return b, nil
}

// OutOfProcess reports whether the data plane serves the disk (the root survives this
// process).
func (b *Block) OutOfProcess() bool {
	_, ok := b.disk.(*dataplane.RemoteDisk)
	return ok
}

// DropSyncs tells the disk that its directory is deleted after Close, so the flushes the
// unmount and the loop device's detach send need not reach the host's disk (see
// stack.Stack.DropSyncs). Only for a root nothing runs on any more and whose data goes.
func (b *Block) DropSyncs() error {
	if b.disk == nil {
		return nil
	}
	return b.disk.DropSyncs()
}

// Device is the loop device the filesystem is mounted from.
func (b *Block) Device() string { return b.loop.Path() }

// DiskPath is the file the loop device is attached to (the served stack).
func (b *Block) DiskPath() string { return b.disk.Path() }

// Size is the block device's size in bytes.
func (b *Block) Size() int64 { return b.disk.Size() }

// Lowers returns the stack's current sealed layers, bottom first; none once closed or
// abandoned.
func (b *Block) Lowers() []stack.LayerRef {
	if b.disk == nil {
		return nil
	}
	return b.disk.Lowers()
}

// UpperBytes is the size of the upper's data file (what this root wrote since its last
// snapshot, plus headers).
func (b *Block) UpperBytes() int64 { return dataplane.UpperBytes(b.dir) }

// Abandon lets go of this process's handles on the root without unmounting, detaching or
// closing anything: what a crash of the process does (tests use it to simulate one).
func (b *Block) Abandon() {
	if b.loop != nil {
		b.loop.Release()
		b.loop = nil
	}
	b.disk, b.undirty = nil, nil
}

// Close unmounts the filesystem, which lets the loop device detach itself (autoclear),
// and stops serving the stack.
// It is idempotent; the upper's files are left for the caller to remove.
func (b *Block) Close() error {
	var errs []error
	if b.loop != nil {
		if err := unmount(b.target); err != nil {
			errs = append(errs, err)
		}
		if b.undirty != nil {
			errs = append(errs, b.undirty())
			b.undirty = nil
		}
		errs = append(errs, b.loop.Detach())
		b.loop = nil
	}
	if b.disk != nil {
		errs = append(errs, b.disk.Close())
		b.disk = nil
	}
	return errors.Join(errs...)
}

// unmount unmounts dir if it is a mount point; a busy mount is detached lazily so the
// name goes away, and the loop device then clears itself (autoclear) once released.
func unmount(dir string) error {
	err := unix.Unmount(dir, 0)
	switch {
	case err == nil, errors.Is(err, unix.EINVAL), errors.Is(err, unix.ENOENT):
		return nil
	case errors.Is(err, unix.EBUSY):
		if lerr := unix.Unmount(dir, unix.MNT_DETACH); lerr != nil && !errors.Is(lerr, unix.EINVAL) {
			return fmt.Errorf("rootfs: unmount %s: %w", dir, lerr)
		}
		return fmt.Errorf("rootfs: %s was busy: %w", dir, blockdev.ErrStillInUse)
	default:
		return fmt.Errorf("rootfs: unmount %s: %w", dir, err)
	}
}

// mountExt4 mounts dev at target with the new mount API, id-mapped to userns when >= 0,
// so the mount exists only once (no plain mount to bind from); read-only with ro.
func mountExt4(dev, target string, userns int, ro bool) error {
	fsfd, err := unix.Fsopen("ext4", unix.FSOPEN_CLOEXEC)
	if err != nil {
		return fmt.Errorf("rootfs: fsopen ext4: %w", err)
	}
	defer unix.Close(fsfd)
	if err := unix.FsconfigSetString(fsfd, "source", dev); err != nil {
		return fmt.Errorf("rootfs: fsconfig source %s: %w", dev, err)
	}
	// No background zeroing of inode tables: it would write most of the device's inode
	// tables into this sandbox's upper, and delay the first freeze while it runs.
	if err := unix.FsconfigSetFlag(fsfd, "noinit_itable"); err != nil {
		return fmt.Errorf("rootfs: fsconfig noinit_itable: %w", err)
	}
	attrs := unix.MOUNT_ATTR_NOATIME | unix.MOUNT_ATTR_NODEV
	if ro {
		if err := unix.FsconfigSetFlag(fsfd, "ro"); err != nil {
			return fmt.Errorf("rootfs: fsconfig ro: %w", err)
		}
		attrs |= unix.MOUNT_ATTR_RDONLY
	}
	if err := unix.FsconfigCreate(fsfd); err != nil {
		return fmt.Errorf("rootfs: mount ext4 from %s: %w", dev, err)
	}
	mfd, err := unix.Fsmount(fsfd, unix.FSMOUNT_CLOEXEC, attrs)
	if err != nil {
		return fmt.Errorf("rootfs: fsmount %s: %w", dev, err)
	}
	defer unix.Close(mfd)
	if userns >= 0 {
		attr := &unix.MountAttr{Attr_set: unix.MOUNT_ATTR_IDMAP, Userns_fd: uint64(userns)}
		if err := unix.MountSetattr(mfd, "", unix.AT_EMPTY_PATH, attr); err != nil {
			return fmt.Errorf("rootfs: id-map ext4 mount: %w", err)
		}
	}
	if err := unix.MoveMount(mfd, "", unix.AT_FDCWD, target, unix.MOVE_MOUNT_F_EMPTY_PATH); err != nil {
		return fmt.Errorf("rootfs: move_mount to %s: %w", target, err)
	}
	return nil
}

// grow resizes the (unmounted) filesystem on dev to the whole device. Offline, because an
// online resize needs CAP_SYS_RESOURCE, which container hosts often drop; -f skips the
// "run e2fsck first" check: the filesystem comes from sealed layers of a clean unmount or
// a frozen snapshot.
func grow(ctx context.Context, dev string) error {
	out, err := exec.CommandContext(ctx, "resize2fs", "-f", dev).CombinedOutput()
	if err != nil {
		return fmt.Errorf("rootfs: resize2fs %s: %w: %s", dev, err, strings.TrimSpace(string(out)))
	}
	return nil
}

// ext4SizeOfFile reads the filesystem size from the ext4 superblock in the device file.
// It reads with O_DIRECT so no page of the file stays cached beside the loop device's
// direct I/O.
func ext4SizeOfFile(path string) (uint64, error) {
	fd, err := unix.Open(path, unix.O_RDONLY|unix.O_DIRECT|unix.O_CLOEXEC, 0)
	if err != nil {
		return 0, fmt.Errorf("rootfs: read superblock: %w", err)
	}
	defer unix.Close(fd)
	buf := alignedBlock()
	if _, err := unix.Pread(fd, buf, 0); err != nil {
		return 0, fmt.Errorf("rootfs: read superblock: %w", err)
	}
	return ext4Size(bytes.NewReader(buf))
}

// ext4Size reads the filesystem size from the ext4 superblock at offset 1024 of r.
func ext4Size(r io.ReaderAt) (uint64, error) {
	sb := make([]byte, 1024)
	if _, err := r.ReadAt(sb, 1024); err != nil {
		return 0, fmt.Errorf("rootfs: read superblock: %w", err)
	}
	if binary.LittleEndian.Uint16(sb[0x38:]) != 0xEF53 {
		return 0, ErrNotExt4
	}
	blocks := uint64(binary.LittleEndian.Uint32(sb[0x4:]))
	const incompat64bit = 0x80
	if binary.LittleEndian.Uint32(sb[0x60:])&incompat64bit != 0 {
		blocks |= uint64(binary.LittleEndian.Uint32(sb[0x150:])) << 32
	}
	logBlock := binary.LittleEndian.Uint32(sb[0x18:])
	if logBlock > 6 {
		return 0, fmt.Errorf("%w: block size 2^(10+%d)", ErrNotExt4, logBlock)
	}
	return blocks << (10 + logBlock), nil
}

// alignedBlock is a 4 KiB buffer aligned for O_DIRECT.
func alignedBlock() []byte {
	const n = 4096
	raw := make([]byte, 2*n)
	off := n - int(uintptr(unsafe.Pointer(&raw[0]))&(n-1))
	if off == n {
		off = 0
	}
	return raw[off : off+n]
}
