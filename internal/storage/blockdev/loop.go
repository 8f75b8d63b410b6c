package blockdev

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"path/filepath"
	"strings"
	"time"

	"golang.org/x/sys/unix"
)

// Loop is an attached loop device. It is configured with autoclear, so if
// the process dies the kernel detaches it once nothing else holds it.
type Loop struct {
	path string
	f    *os.File // held open: autoclear detaches on last close
}

// LoopOptions tune a loop device.
type LoopOptions struct {
	ReadOnly bool
	// DirectIO makes the loop device read and write its backing file with O_DIRECT
	// (when the backing file allows it; otherwise it stays buffered). Over a FUSE
	// file that keeps the data out of the FUSE file's page cache: it is cached once,
	// above the loop device, instead of twice, and a flush of the device no longer
	// has to write a second copy of the dirty data through FUSE first.
	DirectIO bool
	// Name is recorded in the device as its backing file's name (LO_NAME, 63 bytes) in
	// place of the backing path: what a sweep matches against its root once the backing
	// file is gone from view, so a device serving a directory's disk from a shared
	// mount elsewhere (blockdev.Files) names that directory. Empty records the path.
	Name string
}

// AttachLoop attaches backing (a regular file, e.g. Mount.Path()) to a free
// loop device, buffered.
func AttachLoop(ctx context.Context, backing string, readOnly bool) (*Loop, error) {
	return AttachLoopWith(ctx, backing, LoopOptions{ReadOnly: readOnly})
}

// AttachLoopWith attaches backing to a free loop device with options o.
func AttachLoopWith(ctx context.Context, backing string, o LoopOptions) (*Loop, error) {
	readOnly := o.ReadOnly
	flag := os.O_RDWR
	if readOnly {
		flag = os.O_RDONLY
	}
	bf, err := os.OpenFile(backing, flag, 0)
	if err != nil {
		return nil, fmt.Errorf("blockdev: open backing file: %w", err)
	}
	defer bf.Close()
	ctl, err := os.OpenFile("/dev/loop-control", os.O_RDWR, 0)
	if err != nil {
		return nil, fmt.Errorf("blockdev: loop devices unavailable: %w", err)
	}
	defer ctl.Close()
	dio := o.DirectIO
	// Other processes race for free devices; retry on EBUSY, and on a device removed
	// before it was opened.
	for attempt := 0; ; attempt++ {
		if err := ctx.Err(); err != nil {
			return nil, err
		}
		n, err := unix.IoctlRetInt(int(ctl.Fd()), unix.LOOP_CTL_GET_FREE)
		if err != nil {
			return nil, fmt.Errorf("blockdev: LOOP_CTL_GET_FREE: %w", err)
		}
		path := fmt.Sprintf("/dev/loop%d", n)
		lf, err := os.OpenFile(path, flag, 0)
		if err != nil {
			// Removed since LOOP_CTL_GET_FREE handed it out (TrimFreeLoops elsewhere).
			if (errors.Is(err, unix.ENXIO) || errors.Is(err, os.ErrNotExist)) && attempt < 20 {
				continue
			}
			return nil, fmt.Errorf("blockdev: %w", err)
		}
		cfg := unix.LoopConfig{Fd: uint32(bf.Fd())}
		cfg.Info.Flags = unix.LO_FLAGS_AUTOCLEAR
		if readOnly {
			cfg.Info.Flags |= unix.LO_FLAGS_READ_ONLY
		}
		if dio {
			cfg.Info.Flags |= unix.LO_FLAGS_DIRECT_IO
		}
		name := o.Name
		if name == "" {
			name = backing
		}
		copy(cfg.Info.File_name[:len(cfg.Info.File_name)-1], name)
		err = unix.IoctlLoopConfigure(int(lf.Fd()), &cfg)
		if err == nil {
			slog.Debug("blockdev: loop attached", "dev", path, "backing", backing)
			return &Loop{path: path, f: lf}, nil
		}
		lf.Close()
		if dio && errors.Is(err, unix.EINVAL) {
			// Kernels that refuse rather than ignore direct I/O the file cannot do.
			slog.Debug("blockdev: loop direct I/O refused; buffered", "backing", backing)
			dio = false
			continue
		}
		if !errors.Is(err, unix.EBUSY) || attempt > 20 {
			return nil, fmt.Errorf("blockdev: configure %s: %w", path, err)
		}
		time.Sleep(time.Duration(attempt+1) * 5 * time.Millisecond)
	}
}

// Path is the device node, e.g. /dev/loop3.
func (l *Loop) Path() string { return l.path }

// Detach flushes and detaches the device. It is idempotent.
func (l *Loop) Detach() error {
	if l.f == nil {
		return nil
	}
	fd := int(l.f.Fd())
	_ = unix.Fsync(fd)
	err := unix.IoctlSetInt(fd, unix.LOOP_CLR_FD, 0)
	l.f.Close()
	l.f = nil
	if err != nil && !errors.Is(err, unix.ENXIO) {
		// Still in use (mounted): autoclear detaches it on last close.
		return fmt.Errorf("blockdev: detach %s: %w", l.path, err)
	}
	return nil
}

// HeldLoop is a loop device that something else holds attached, a filesystem mounted
// from it typically: this process keeps no descriptor on it, so Detach does nothing and
// autoclear detaches the device once its last holder lets go. Every descriptor a process
// holds is copied into each child it starts and closed again by the child's exec, so a
// node that kept one per mounted root paid for all of them on every `runc` it ran.
func HeldLoop(dev string) *Loop { return &Loop{path: dev} }

// Release lets go of the device without detaching it.
func (l *Loop) Release() {
	if l.f != nil {
		l.f.Close()
		l.f = nil
	}
}

// LoopBacking is the backing file of loop device dev (e.g. /dev/loop3) as sysfs shows it.
func LoopBacking(dev string) (string, error) {
	raw, err := os.ReadFile(filepath.Join("/sys/block", filepath.Base(dev), "loop", "backing_file"))
	if err != nil {
		return "", fmt.Errorf("blockdev: backing file of %s: %w", dev, err)
	}
	return strings.TrimSuffix(strings.TrimSpace(string(raw)), " (deleted)"), nil
}

// MountedDevice is the block device (/dev/NAME) of the filesystem mounted at dir.
func MountedDevice(dir string) (string, error) {
	m, err := ReadMounts()
	if err != nil {
		return "", err
	}
	return m.Device(dir)
}

// Mounts is a snapshot of this process's mount table. A restart that adopts hundreds of
// roots reads it once rather than once per root (mountinfo grows with every root, so
// reading it per root costs the square of their number).
type Mounts struct{ entries []mountEntry }

// ReadMounts reads the mount table.
func ReadMounts() (Mounts, error) {
	e, err := readMountinfo()
	return Mounts{entries: e}, err
}

// Device is the block device (/dev/NAME) of the filesystem mounted at dir (the topmost
// mount there).
func (ms Mounts) Device(dir string) (string, error) {
	m := ms.top(dir)
	if m.dir == "" {
		return "", fmt.Errorf("blockdev: nothing mounted at %s", dir)
	}
	// The link's last element is the device's kernel name (DEVNAME), with '!' for '/':
	// one readlink, where its uevent file takes an open, a stat, two reads and a close
	// (a restart does it for every root it adopts).
	link, err := os.Readlink(fmt.Sprintf("/sys/dev/block/%d:%d", unix.Major(m.dev), unix.Minor(m.dev)))
	if err != nil {
		return "", fmt.Errorf("blockdev: %s is not mounted from a block device: %w", dir, err)
	}
	name := strings.ReplaceAll(filepath.Base(link), "!", "/")
	if name == "" || name == "." || name == "/" {
		return "", fmt.Errorf("blockdev: no device name for the mount at %s", dir)
	}
	return "/dev/" + name, nil
}

// FSType is the filesystem type of the topmost mount at dir, "" when nothing is mounted
// there.
func (ms Mounts) FSType(dir string) string { return ms.top(dir).fstype }

// top is the topmost mount at dir.
func (ms Mounts) top(dir string) mountEntry {
	for i := len(ms.entries) - 1; i >= 0; i-- {
		if ms.entries[i].dir == dir {
			return ms.entries[i]
		}
	}
	return mountEntry{}
}

// FUSEUnder lists the mount points of this package's FUSE files under root that are not
// under one of keep: the connections a sweep of root (SweepLoops) would abort.
func (ms Mounts) FUSEUnder(root string, keep ...string) []string {
	var out []string
	kept := newDirSet(keep)
	for _, m := range ms.entries {
		if m.fstype != fsType || m.source != fsName || !under(m.dir, root) {
			continue
		}
		if !kept.holds(m.dir) {
			out = append(out, m.dir)
		}
	}
	return out
}
