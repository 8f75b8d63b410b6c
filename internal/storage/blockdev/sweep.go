package blockdev

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"time"

	"github.com/moby/sys/mountinfo"
	"golang.org/x/sys/unix"
)

// fuseCtlDir is where fusectl lists FUSE connections; writing to a connection's abort
// file fails every request pending on it, and every later one, at once.
const fuseCtlDir = "/sys/fs/fuse/connections"

// fuseCtlMagic is fusectl's statfs magic.
const fuseCtlMagic = 0x65735543

// opTimeout bounds each kernel operation of a sweep. A syscall stuck on a FUSE
// connection nobody serves cannot be interrupted, so rather than wait the sweep reports
// it and goes on (leaving one thread stuck).
var opTimeout = 5 * time.Second

// Sweep removes what a crashed process left under root. See SweepLoops.
func Sweep(ctx context.Context, root string) error {
	_, err := SweepLoops(ctx, root)
	return err
}

// SweepLoops removes what a crashed process left under root and returns the loop devices
// it found attached to it (detached now, or once their last user lets go), so a caller
// can undo settings of its own on them. Call it at startup, after killing the processes
// that used the devices.
//
// When the process serving a device dies, whatever touches the device file waits forever
// for an answer: loop workers, the ext4 journal above the loop device, unmount. So the
// sweep first aborts the FUSE connections of this package's mounts under root, which
// fails those requests at once; then it lazily unmounts every filesystem mounted from a
// loop device backed by one of those files, detaches the loop devices, and lazily
// unmounts the FUSE mounts. A loop device whose FUSE mount is no longer visible (its
// backing file shows as "/disk": the mount was detached, or lived in a mount namespace
// that is gone), or whose file a shared mount outside root serves (Files), is recognised
// by the name AttachLoop recorded in it (LoopOptions.Name) and by its backing device,
// the FUSE connection; a connection mounted outside root is not aborted (a live data
// plane serves other disks through it). Connections and loop devices of other roots are
// left alone, and so is everything under a directory in keep (devices a live process
// still serves, e.g. the data plane's disks of adopted sandboxes, and its shared mount).
// Each step is bounded by a timeout and by ctx.
func SweepLoops(ctx context.Context, root string, keep ...string) ([]string, error) {
	root, err := filepath.Abs(root)
	if err != nil {
		return nil, fmt.Errorf("blockdev: sweep: %w", err)
	}
	all, err := readMountinfo()
	if err != nil {
		return nil, err
	}
	kept := newDirSet(keep).holds
	keptDevs := map[uint64]bool{}
	var mounts []mountEntry
	for _, m := range all {
		if kept(m.dir) {
			keptDevs[m.dev] = true
			continue
		}
		mounts = append(mounts, m)
	}
	var errs []error
	conns := map[uint64]bool{}     // FUSE connections (device numbers) of root
	elsewhere := map[uint64]bool{} // devices mounted outside root
	ourFUSE := map[string]bool{}   // every mount point of this package's
	var fuseDirs []string
	for _, m := range mounts {
		if m.fstype == fsType && m.source == fsName {
			ourFUSE[m.dir] = true
		}
		switch {
		case m.fstype == fsType && m.source == fsName && under(m.dir, root):
			conns[m.dev] = true
			fuseDirs = append(fuseDirs, m.dir)
		case !under(m.dir, root):
			elsewhere[m.dev] = true
		}
	}
	aborted := map[uint64]bool{}
	abort := func() {
		for c := range conns {
			if !aborted[c] {
				aborted[c] = true
				errs = append(errs, abortConn(c))
			}
		}
	}
	// Before anything touches the files: with the server gone, the loop devices' opens
	// and ioctls below could wait on it too.
	abort()

	var ours []loopDev
	for _, l := range listLoops(kept) {
		if keptDevs[l.dev] {
			continue
		}
		mine := under(l.backing, root)
		if !mine {
			for _, m := range mounts {
				if m.dev == l.dev && under(m.dir, root) {
					mine = true
					break
				}
			}
		}
		// A device of root whose file is served from elsewhere (a shared mount, see
		// Files), or whose mount is no longer visible, is known by the name it records.
		if !mine && !ourFUSE[filepath.Dir(l.backing)] && !detachedFile(l.backing) {
			continue
		}
		info, err := bounded(ctx, "status of "+l.path, func() (*unix.LoopInfo64, error) { return loopStatus(l.path) })
		if err != nil {
			if mine {
				errs = append(errs, err)
				ours = append(ours, l)
			}
			continue
		}
		name := string(info.File_name[:])
		if i := strings.IndexByte(name, 0); i >= 0 {
			name = name[:i]
		}
		// The name is cut at 63 bytes, but a cut keeps root as a prefix.
		if !mine && !strings.HasPrefix(name, root+"/") || kept(name) {
			continue
		}
		ours = append(ours, l)
		if c := info.Device; unix.Major(c) == 0 && !elsewhere[c] && !keptDevs[c] && connExists(c) {
			conns[c] = true
		}
	}
	abort()

	// Filesystems mounted from our loop devices, deepest first.
	loopDevs := map[uint64]bool{}
	for _, l := range ours {
		loopDevs[l.dev] = true
	}
	for i := len(mounts) - 1; i >= 0; i-- {
		if m := mounts[i]; loopDevs[m.dev] {
			if _, err := bounded(ctx, "unmount "+m.dir, func() (struct{}, error) { return struct{}{}, lazyUnmount(m.dir) }); err != nil {
				errs = append(errs, err)
				continue
			}
			slog.Info("blockdev: swept mount of a loop device", "dir", m.dir, "dev", m.source)
		}
	}
	var paths []string
	for _, l := range ours {
		paths = append(paths, l.path)
		if _, err := bounded(ctx, "detach "+l.path, func() (struct{}, error) { return struct{}{}, clearLoop(l.path) }); err != nil {
			errs = append(errs, err)
			continue
		}
		slog.Info("blockdev: swept loop device", "dev", l.path, "backing", l.backing)
	}
	for i := len(fuseDirs) - 1; i >= 0; i-- {
		dir := fuseDirs[i]
		if _, err := bounded(ctx, "unmount "+dir, func() (struct{}, error) { return struct{}{}, lazyUnmount(dir) }); err != nil {
			errs = append(errs, err)
			continue
		}
		slog.Info("blockdev: swept fuse mount", "dir", dir)
	}
	return paths, errors.Join(errs...)
}

// detachedFile reports whether a loop device's backing file, as sysfs shows it, is a file
// of this package's whose mount was detached: sysfs then shows the path from the
// detached mount's root, "/disk" or a shared mount's "/disk.N".
func detachedFile(backing string) bool {
	name, ok := strings.CutPrefix(backing, "/"+FileName)
	return ok && (name == "" || name[0] == '.' && !strings.Contains(name, "/"))
}

// bounded runs f on its own goroutine and stops waiting for it after opTimeout or when
// ctx ends.
func bounded[T any](ctx context.Context, what string, f func() (T, error)) (T, error) {
	type result struct {
		v   T
		err error
	}
	done := make(chan result, 1)
	go func() {
		v, err := f()
		done <- result{v, err}
	}()
	t := time.NewTimer(opTimeout)
	defer t.Stop()
	var zero T
	select {
	case r := <-done:
		return r.v, r.err
	case <-t.C:
		return zero, fmt.Errorf("blockdev: sweep: %s: still blocked after %v", what, opTimeout)
	case <-ctx.Done():
		return zero, fmt.Errorf("blockdev: sweep: %s: %w", what, ctx.Err())
	}
}

// connName is the name of a FUSE connection in fusectl: the kernel's encoding of the
// mount's device number.
func connName(dev uint64) string {
	return strconv.FormatUint(uint64(unix.Major(dev))<<20|uint64(unix.Minor(dev)), 10)
}

func connExists(dev uint64) bool {
	if err := mountFuseCtl(); err != nil {
		return false
	}
	_, err := os.Stat(filepath.Join(fuseCtlDir, connName(dev)))
	return err == nil
}

// abortConn aborts the FUSE connection of device dev; one already gone is fine.
func abortConn(dev uint64) error {
	if err := mountFuseCtl(); err != nil {
		return err
	}
	p := filepath.Join(fuseCtlDir, connName(dev), "abort")
	if err := os.WriteFile(p, []byte("1"), 0o200); err != nil {
		if errors.Is(err, os.ErrNotExist) {
			return nil
		}
		return fmt.Errorf("blockdev: sweep: abort fuse connection: %w", err)
	}
	slog.Info("blockdev: aborted fuse connection", "conn", connName(dev))
	return nil
}

// mountFuseCtl mounts fusectl where the kernel expects it unless it is there.
func mountFuseCtl() error {
	var st unix.Statfs_t
	if err := unix.Statfs(fuseCtlDir, &st); err != nil {
		return fmt.Errorf("blockdev: %s: %w", fuseCtlDir, err)
	}
	if st.Type == fuseCtlMagic {
		return nil
	}
	if err := unix.Mount("fusectl", fuseCtlDir, "fusectl", 0, ""); err != nil && !errors.Is(err, unix.EBUSY) {
		return fmt.Errorf("blockdev: mount fusectl: %w", err)
	}
	return nil
}

func loopStatus(dev string) (*unix.LoopInfo64, error) {
	f, err := os.OpenFile(dev, os.O_RDONLY, 0)
	if err != nil {
		return nil, fmt.Errorf("blockdev: sweep: %w", err)
	}
	defer f.Close()
	info, err := unix.IoctlLoopGetStatus64(int(f.Fd()))
	if err != nil {
		return nil, fmt.Errorf("blockdev: sweep: status of %s: %w", dev, err)
	}
	return info, nil
}

// clearLoop detaches a loop device, or (in use, e.g. by a mount a process still holds)
// marks it to detach itself on its last close.
func clearLoop(dev string) error {
	f, err := os.OpenFile(dev, os.O_RDONLY, 0)
	if err != nil {
		return fmt.Errorf("blockdev: sweep %s: %w", dev, err)
	}
	defer f.Close()
	if err := unix.IoctlSetInt(int(f.Fd()), unix.LOOP_CLR_FD, 0); err != nil && !errors.Is(err, unix.ENXIO) {
		info, gerr := unix.IoctlLoopGetStatus64(int(f.Fd()))
		if gerr == nil {
			info.Flags |= unix.LO_FLAGS_AUTOCLEAR
			_ = unix.IoctlLoopSetStatus64(int(f.Fd()), info)
		}
		return fmt.Errorf("blockdev: sweep detach %s: %w", dev, err)
	}
	return nil
}

// loopDev is an attached loop device.
type loopDev struct {
	path    string // /dev/loopN
	dev     uint64 // its device number
	backing string // its backing file as sysfs shows it
}

// listLoops lists the attached loop devices from sysfs, without opening them, except
// those whose backing file skip accepts (a restart keeps hundreds of them: only their
// backing file is read).
func listLoops(skip func(backing string) bool) []loopDev {
	ents, _ := os.ReadDir("/sys/block")
	var out []loopDev
	for _, e := range ents {
		name := e.Name()
		if !strings.HasPrefix(name, "loop") {
			continue
		}
		sys := "/sys/block/" + name
		b, err := os.ReadFile(sys + "/loop/backing_file")
		if err != nil {
			continue // not attached
		}
		backing := strings.TrimSuffix(strings.TrimSuffix(string(b), "\n"), " (deleted)")
		if skip(backing) {
			continue
		}
		raw, err := os.ReadFile(sys + "/dev")
		if err != nil {
			continue
		}
		dev, ok := parseDev(strings.TrimSpace(string(raw)))
		if !ok {
			continue
		}
		out = append(out, loopDev{path: "/dev/" + name, dev: dev, backing: backing})
	}
	return out
}

// under reports whether p is root or a path below it (without allocating: sweeps compare
// every mount with every kept directory).
func under(p, root string) bool {
	return p == root || len(p) > len(root) && p[len(root)] == filepath.Separator && strings.HasPrefix(p, root)
}

// dirSet answers whether a path is one of its directories or below one, in as many map
// lookups as the path has parents, however many directories the set holds (a restart
// keeps hundreds, and the mount table and the loop devices grow with them).
type dirSet map[string]struct{}

func newDirSet(dirs []string) dirSet {
	s := make(dirSet, len(dirs))
	for _, d := range dirs {
		s[filepath.Clean(d)] = struct{}{}
	}
	return s
}

func (s dirSet) holds(p string) bool {
	if len(s) == 0 {
		return false
	}
	for {
		if _, ok := s[p]; ok {
			return true
		}
		i := strings.LastIndexByte(p, filepath.Separator)
		if i < 0 {
			return false
		}
		if i == 0 {
			if p == "/" {
				return false
			}
			p = "/"
			continue
		}
		p = p[:i]
	}
}

// mountEntry is one line of /proc/self/mountinfo.
type mountEntry struct {
	dev    uint64 // st_dev of the mounted filesystem
	dir    string
	fstype string
	source string
}

func readMountinfo() ([]mountEntry, error) {
	infos, err := mountinfo.GetMounts(nil)
	if err != nil {
		return nil, fmt.Errorf("blockdev: mountinfo: %w", err)
	}
	out := make([]mountEntry, 0, len(infos))
	for _, m := range infos {
		out = append(out, mountEntry{dev: unix.Mkdev(uint32(m.Major), uint32(m.Minor)), dir: m.Mountpoint, fstype: m.FSType, source: m.Source})
	}
	return out, nil
}

// parseDev parses "major:minor".
func parseDev(s string) (uint64, bool) {
	a, b, ok := strings.Cut(s, ":")
	if !ok {
		return 0, false
	}
	maj, err1 := strconv.ParseUint(a, 10, 32)
	min, err2 := strconv.ParseUint(b, 10, 32)
	if err1 != nil || err2 != nil {
		return 0, false
	}
	return unix.Mkdev(uint32(maj), uint32(min)), true
}

// fuseMounts lists mount points of our FUSE filesystems under root, in mountinfo order.
func fuseMounts(root string) ([]string, error) {
	mounts, err := readMountinfo()
	if err != nil {
		return nil, err
	}
	var out []string
	for _, m := range mounts {
		if m.fstype == fsType && m.source == fsName && under(m.dir, root) {
			out = append(out, m.dir)
		}
	}
	return out, nil
}
