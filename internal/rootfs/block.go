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
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"

	"github.com/aenv-dev/aenv/internal/storage/blockdev"
	"github.com/aenv-dev/aenv/internal/storage/stack"
	"golang.org/x/sys/unix"
)

// ErrNotExt4 means the stack does not hold an ext4 filesystem.
var ErrNotExt4 = errors.New("rootfs: device holds no ext4 filesystem")

// Names inside Spec.Dir.
const (
	upperData  = "upper.data"
	upperIndex = "upper.index"
	exposeDir  = "blk" // FUSE mount point lives at blk/fuse
)

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
	// Resolver opens lowers that have no path; optional.
	Resolver stack.Resolver
	// MaxDirty caps the page cache the root may hold dirty (bytes; 0 = DefaultMaxDirty),
	// and with it what a snapshot has to flush; the upper's unsynced growth on the host
	// stays within 4*MaxDirty.
	MaxDirty uint64
}

// Block is a mounted block root. Close releases it; the upper's files stay in Dir.
type Block struct {
	dir      string
	st       *stack.Stack
	ex       *blockdev.Exposed
	target   string
	log      *slog.Logger
	undirty  func() error // restores the loop device's dirty limits
	stopSync chan struct{}
	synced   chan struct{}
	// flushMu keeps the flusher's fsyncs out of a snapshot's frozen window: the seal
	// waits for the stack's I/O, an fsync included.
	flushMu sync.Mutex
}

// Open opens the stack (creating an empty upper in spec.Dir), exposes it as a loop device
// and mounts it at spec.Target. On error nothing stays mounted or attached.
func Open(ctx context.Context, spec Spec) (b *Block, err error) {
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
	b = &Block{dir: spec.Dir, st: st, target: spec.Target, log: slog.Default()}
	defer func() {
		if err != nil {
			err = errors.Join(err, b.Close())
		}
	}()
	fsSize, err := ext4Size(st)
	if err != nil {
		return b, err
	}
	b.ex, err = blockdev.Expose(ctx, filepath.Join(spec.Dir, exposeDir), st, blockdev.MountOptions{})
	if err != nil {
		return b, fmt.Errorf("rootfs: expose: %w", err)
	}
	if spec.MaxDirty == 0 {
		spec.MaxDirty = DefaultMaxDirty
	}
	if b.undirty, err = limitDirty(b.ex.Device(), spec.MaxDirty); err != nil {
		// Only snapshot latency suffers (it then grows with unflushed data).
		b.log.Warn("rootfs: no dirty page limit", "dev", b.ex.Device(), "err", err)
		err = nil
	}
	// Grow only by whole megabytes: rounding differences are not worth a resize2fs.
	if uint64(st.Size()) >= fsSize+1<<20 {
		if err := grow(ctx, b.ex.Device()); err != nil {
			return b, err
		}
	}
	if err := os.MkdirAll(spec.Target, 0o755); err != nil {
		return b, fmt.Errorf("rootfs: %w", err)
	}
	if err := mountExt4(b.ex.Device(), spec.Target, spec.UserNS); err != nil {
		return b, err
	}
	b.stopSync, b.synced = make(chan struct{}), make(chan struct{})
	go b.flusher(spec.MaxDirty, b.stopSync, b.synced)
	return b, nil
}

// Device is the loop device the filesystem is mounted from.
func (b *Block) Device() string { return b.ex.Device() }

// Size is the block device's size in bytes.
func (b *Block) Size() int64 { return b.st.Size() }

// Lowers returns the stack's current sealed layers, bottom first.
func (b *Block) Lowers() []stack.LayerRef { return b.st.Manifest().Lowers }

// UpperBytes is the size of the upper's data file (what this root wrote since its last
// snapshot, plus headers).
func (b *Block) UpperBytes() int64 {
	m := b.st.Manifest()
	fi, err := os.Stat(filepath.Join(m.Dir, upperData))
	if err != nil {
		return 0
	}
	return fi.Size()
}

// Close unmounts the filesystem, detaches the loop device, unmounts FUSE and closes the
// stack. It is idempotent; the upper's files are left for the caller to remove.
func (b *Block) Close() error {
	var errs []error
	if b.stopSync != nil {
		close(b.stopSync)
		<-b.synced
		b.stopSync = nil
	}
	if b.ex != nil {
		if err := unmount(b.target); err != nil {
			errs = append(errs, err)
		}
		if b.undirty != nil {
			errs = append(errs, b.undirty())
			b.undirty = nil
		}
		errs = append(errs, b.ex.Close())
		b.ex = nil
	}
	if b.st != nil {
		errs = append(errs, b.st.Close())
		b.st = nil
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
		return fmt.Errorf("rootfs: %s was busy; detached lazily", dir)
	default:
		return fmt.Errorf("rootfs: unmount %s: %w", dir, err)
	}
}

// mountExt4 mounts dev at target with the new mount API, id-mapped to userns when >= 0,
// so the mount exists only once (no plain mount to bind from).
func mountExt4(dev, target string, userns int) error {
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
	if err := unix.FsconfigCreate(fsfd); err != nil {
		return fmt.Errorf("rootfs: mount ext4 from %s: %w", dev, err)
	}
	mfd, err := unix.Fsmount(fsfd, unix.FSMOUNT_CLOEXEC, unix.MOUNT_ATTR_NOATIME|unix.MOUNT_ATTR_NODEV)
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

// ext4Size reads the filesystem size from the ext4 superblock on the device.
func ext4Size(st *stack.Stack) (uint64, error) {
	sb := make([]byte, 1024)
	if _, err := st.ReadAt(sb, 1024); err != nil {
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
