package blockdev

import (
	"bufio"
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

// AttachLoop attaches backing (a regular file, e.g. Mount.Path()) to a free
// loop device.
func AttachLoop(ctx context.Context, backing string, readOnly bool) (*Loop, error) {
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
	// Other processes race for free devices; retry on EBUSY.
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
			return nil, fmt.Errorf("blockdev: %w", err)
		}
		cfg := unix.LoopConfig{Fd: uint32(bf.Fd())}
		cfg.Info.Flags = unix.LO_FLAGS_AUTOCLEAR
		if readOnly {
			cfg.Info.Flags |= unix.LO_FLAGS_READ_ONLY
		}
		copy(cfg.Info.File_name[:], backing)
		err = unix.IoctlLoopConfigure(int(lf.Fd()), &cfg)
		if err == nil {
			slog.Debug("blockdev: loop attached", "dev", path, "backing", backing)
			return &Loop{path: path, f: lf}, nil
		}
		lf.Close()
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

// Sweep removes what a crashed process left under root: loop devices whose
// backing file lies under root are detached and FUSE mounts of this package
// under root are unmounted (lazily when busy). Call it at startup.
func Sweep(ctx context.Context, root string) error {
	root, err := filepath.Abs(root)
	if err != nil {
		return err
	}
	var errs []error
	loops, _ := filepath.Glob("/sys/block/loop*/loop/backing_file")
	for _, bf := range loops {
		b, err := os.ReadFile(bf)
		if err != nil {
			continue
		}
		backing := strings.TrimSuffix(strings.TrimSuffix(string(b), "\n"), " (deleted)")
		if !under(backing, root) {
			continue
		}
		dev := "/dev/" + filepath.Base(filepath.Dir(filepath.Dir(bf)))
		if err := clearLoop(dev); err != nil {
			errs = append(errs, err)
		} else {
			slog.Info("blockdev: swept loop device", "dev", dev, "backing", backing)
		}
	}
	mounts, err := fuseMounts(root)
	if err != nil {
		errs = append(errs, err)
	}
	// Unmount deepest first.
	for i := len(mounts) - 1; i >= 0; i-- {
		if err := unix.Unmount(mounts[i], unix.MNT_DETACH); err != nil && !errors.Is(err, unix.EINVAL) {
			errs = append(errs, fmt.Errorf("blockdev: sweep unmount %s: %w", mounts[i], err))
			continue
		}
		slog.Info("blockdev: swept fuse mount", "dir", mounts[i])
	}
	return errors.Join(errs...)
}

func clearLoop(dev string) error {
	f, err := os.OpenFile(dev, os.O_RDONLY, 0)
	if err != nil {
		return fmt.Errorf("blockdev: sweep %s: %w", dev, err)
	}
	defer f.Close()
	if err := unix.IoctlSetInt(int(f.Fd()), unix.LOOP_CLR_FD, 0); err != nil && !errors.Is(err, unix.ENXIO) {
		// Busy (mounted): mark autoclear so it goes when released.
		info, gerr := unix.IoctlLoopGetStatus64(int(f.Fd()))
		if gerr == nil {
			info.Flags |= unix.LO_FLAGS_AUTOCLEAR
			_ = unix.IoctlLoopSetStatus64(int(f.Fd()), info)
		}
		return fmt.Errorf("blockdev: sweep detach %s: %w", dev, err)
	}
	return nil
}

func under(p, root string) bool {
	return p == root || strings.HasPrefix(p, root+string(filepath.Separator))
}

// fuseMounts lists mount points of our FUSE filesystems under root, in
// mountinfo order.
func fuseMounts(root string) ([]string, error) {
	f, err := os.Open("/proc/self/mountinfo")
	if err != nil {
		return nil, err
	}
	defer f.Close()
	var out []string
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		fields := strings.Fields(sc.Text())
		sep := -1
		for i, x := range fields {
			if x == "-" {
				sep = i
				break
			}
		}
		if sep < 0 || len(fields) < sep+3 || len(fields) < 5 {
			continue
		}
		mp := unescape(fields[4])
		if strings.HasPrefix(fields[sep+1], "fuse") && fields[sep+2] == fsName && under(mp, root) {
			out = append(out, mp)
		}
	}
	return out, sc.Err()
}

func unescape(s string) string {
	r := strings.NewReplacer(`\040`, " ", `\011`, "\t", `\012`, "\n", `\134`, `\`)
	return r.Replace(s)
}
