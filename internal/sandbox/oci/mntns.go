package oci

import (
	"errors"
	"fmt"
	"log/slog"
	"os/exec"
	"path/filepath"
	"runtime"
	"strings"
	"sync/atomic"

	"github.com/moby/sys/mountinfo"
	"golang.org/x/sys/unix"
)

// launchNS runs the runtime's create commands in a mount namespace of their own that
// holds the host's mounts less every other sandbox's. Each held sandbox adds three
// lines to the host's mount table (its ext4 root, its FUSE disk, its netns bind mount),
// and every create has the kernel format the whole table several times (runc and runc
// init read /proc/self/mountinfo) and copy it into the container's namespace: kernel CPU
// per create grew ~0.08 ms per held sandbox. In a namespace where the sandboxes
// directory and the netns directory hold only this sandbox's mounts, that work no
// longer grows with the count.
//
// The mount point that is detached there is the backend's data directory, bound onto
// itself: not the sandboxes directory, since a snapshot renames a sandbox's upper file
// into the layers directory, and a rename across two mounts fails (EXDEV) even on one
// filesystem.
//
// The namespace belongs to one locked OS thread that is never unlocked, so Go ends the
// thread when its goroutine returns: the namespace dies with the thread and the runtime
// process started from it (a node killed mid-create leaks nothing). The container's own
// namespace is a copy made by runc init, as before.
type launchNS struct {
	root     string // the data directory (sandboxes below it), a mount point of its own
	netnsDir string // the netns directory if it is a mount point of its own, or ""
	// cgroups are the host's cgroup hierarchies no sandbox needs (see
	// sandboxControllers), detached in the namespace so that the runtime skips them.
	cgroups []string
	off     atomic.Bool
	log     *slog.Logger
}

// The launcher's thread changes namespace and is never unlocked, so it must never be the
// main thread: /proc/self shows the main thread's namespace (the node's scans of
// /proc/self/mountinfo would see the launcher's), and Go cannot end the main thread, so
// it would stay in it. Locking the main goroutine to the main thread from an init
// function keeps every other goroutine off it (runtime.LockOSThread's documentation).
func init() { runtime.LockOSThread() }

// errMainThread means the launcher found itself on the main thread (see init).
var errMainThread = errors.New("oci: launcher on the main thread")

// errPrivateNS means the private namespace could not be set up; nothing was run.
var errPrivateNS = errors.New("oci: private mount namespace for the runtime")

// newLaunchNS returns the launcher for sandboxes below dir, making dir a mount point
// (a recursive bind onto itself, kept across restarts) when it is not one yet. A dir that
// is not a mount point but already holds mounts (sandboxes of a node that ran before
// this existed) cannot be made one without hiding them: it returns nil, logged, and the
// runtime runs in the node's namespace until a restart finds no mount below dir.
func newLaunchNS(dir, netnsDir string, log *slog.Logger) *launchNS {
	dir = filepath.Clean(dir)
	if mounted, err := mountinfo.Mounted(dir); err != nil {
		log.Warn("oci: the runtime runs in the host's mount namespace", "err", err)
		return nil
	} else if !mounted {
		below, err := mountsUnder(dir)
		if err != nil {
			log.Warn("oci: the runtime runs in the host's mount namespace", "err", err)
			return nil
		}
		if len(below) > 0 {
			log.Warn("oci: the runtime runs in the host's mount namespace (creates cost more with more sandboxes held) "+
				"until a restart with no sandbox held: the data directory is not a mount point and holds mounts",
				"dir", dir, "mounts", len(below))
			return nil
		}
		if err := unix.Mount(dir, dir, "", unix.MS_BIND|unix.MS_REC, ""); err != nil {
			log.Warn("oci: the runtime runs in the host's mount namespace", "err", fmt.Errorf("bind %s onto itself: %w", dir, err))
			return nil
		}
	}
	ns := &launchNS{root: dir, log: log}
	if hide, err := hostUnneededCgroupMounts(); err != nil {
		log.Warn("oci: sandboxes join every cgroup hierarchy", "err", err)
	} else {
		ns.cgroups = hide
	}
	if mounted, err := mountinfo.Mounted(netnsDir); err == nil && mounted {
		ns.netnsDir = filepath.Clean(netnsDir)
	} else {
		log.Warn("oci: the netns directory is not a mount point: the runtime sees every sandbox's netns mount",
			"dir", netnsDir, "err", err)
	}
	return ns
}

// run runs cmd (not started) for the sandbox whose directory is dir (below the data
// directory) and whose network namespace is mounted at netns ("" for none).
// When the private namespace cannot be made it logs why, stops trying, and runs cmd in
// the node's namespace.
func (ns *launchNS) run(cmd *exec.Cmd, dir, netns string) error {
	if ns == nil || ns.off.Load() {
		return cmd.Run()
	}
	errc := make(chan error, 1)
	go func() {
		// Never unlocked: the thread and its namespace end with this goroutine.
		runtime.LockOSThread()
		if unix.Gettid() == unix.Getpid() {
			runtime.UnlockOSThread()
			errc <- errMainThread
			return
		}
		if err := ns.enter(dir, netns); err != nil {
			errc <- fmt.Errorf("%w: %w", errPrivateNS, err)
			return
		}
		// os/exec forks on this (locked) thread: the child inherits its namespace.
		errc <- cmd.Run()
	}()
	err := <-errc
	if errors.Is(err, errMainThread) {
		return cmd.Run()
	}
	if errors.Is(err, errPrivateNS) {
		if !ns.off.Swap(true) {
			ns.log.Warn("oci: the runtime runs in the host's mount namespace from now on", "err", err)
		}
		return cmd.Run()
	}
	return err
}

// enter moves the calling (locked) thread into a new mount namespace where the data
// directory holds only dir's mounts, the netns directory only netns, and the cgroup root
// only the hierarchies a sandbox needs.
func (ns *launchNS) enter(dir, netns string) error {
	dir = filepath.Clean(dir)
	if rel, err := filepath.Rel(ns.root, dir); err != nil || rel == "." || strings.HasPrefix(rel, "..") {
		return fmt.Errorf("%s is not below %s", dir, ns.root)
	}
	if err := unix.Unshare(unix.CLONE_NEWNS); err != nil {
		return fmt.Errorf("unshare: %w", err)
	}
	// Slave, so that nothing done here reaches the host (an unmount in a peer of the
	// host's mounts would unmount them there too) while the host's later mounts still
	// propagate here, and from here into the container as they did before.
	if err := unix.Mount("", "/", "", unix.MS_SLAVE|unix.MS_REC, ""); err != nil {
		return fmt.Errorf("make / a slave: %w", err)
	}
	moves := []struct{ path, parent string }{{dir, ns.root}}
	if netns != "" && ns.netnsDir != "" && filepath.Dir(filepath.Clean(netns)) == ns.netnsDir {
		moves = append(moves, struct{ path, parent string }{filepath.Clean(netns), ns.netnsDir})
	}
	trees := make([]int, 0, len(moves))
	defer func() {
		for _, fd := range trees {
			unix.Close(fd)
		}
	}()
	// Clone first (a clone keeps the source's idmapping and stays a slave of the host's
	// mount), then detach the directories with every sandbox's mounts, then put the
	// clones back where they were: the directories below the detached mounts are the
	// same ones (each mount is a bind of its own directory).
	for _, m := range moves {
		fd, err := unix.OpenTree(unix.AT_FDCWD, m.path, unix.OPEN_TREE_CLONE|unix.OPEN_TREE_CLOEXEC|unix.AT_RECURSIVE)
		if err != nil {
			return fmt.Errorf("clone %s: %w", m.path, err)
		}
		trees = append(trees, fd)
	}
	for _, m := range moves {
		if err := unix.Unmount(m.parent, unix.MNT_DETACH); err != nil {
			return fmt.Errorf("detach %s: %w", m.parent, err)
		}
	}
	for i, m := range moves {
		if err := unix.MoveMount(trees[i], "", unix.AT_FDCWD, m.path, unix.MOVE_MOUNT_F_EMPTY_PATH); err != nil {
			return fmt.Errorf("put back %s: %w", m.path, err)
		}
	}
	return hideCgroupMounts(ns.cgroups)
}

// release unmounts the data directory's bind onto itself when nothing else is mounted
// below it (no sandbox kept running), so that a node that stops with none held leaves the
// host's mount table as it found it and its data directory removable. With sandboxes
// kept, the bind stays for the restart that adopts them.
func (ns *launchNS) release() error {
	if ns == nil {
		return nil
	}
	below, err := mountsUnder(ns.root)
	if err != nil {
		return fmt.Errorf("oci: release %s: %w", ns.root, err)
	}
	for _, m := range below {
		if m != ns.root {
			return nil
		}
	}
	if len(below) == 0 {
		return nil
	}
	if err := unix.Unmount(ns.root, 0); err != nil {
		return fmt.Errorf("oci: release %s: %w", ns.root, err)
	}
	return nil
}
