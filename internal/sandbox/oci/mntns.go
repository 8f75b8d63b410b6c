package oci

import (
	"errors"
	"fmt"
	"log/slog"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strings"
	"sync"
	"sync/atomic"
	"time"

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
	// keep are host paths launches use (envd): templates keep every mount they are on.
	keep []string
	// cgroups are what the namespace changes in the host's cgroup hierarchies (see
	// sandboxControllers) so that the runtime uses only those sandboxes need: with
	// cgroupView (crun) the hierarchies it shows (showCgroupMounts), else the ones it
	// detaches (hideCgroupMounts, runc); nil: none, the runtime sees all.
	cgroups    []string
	cgroupView bool
	off        atomic.Bool
	log        *slog.Logger

	mu     sync.Mutex
	tmpl   *nsTemplate   // the current template, nil when none was needed lately
	maxAge time.Duration // templateMaxAge, but for tests
}

// templateMaxAge is how long a template serves launches. A launch copies the template's
// namespace instead of the node's, so the copy no longer grows with the mounts of the
// sandboxes held (the data directory and the netns directory are detached there once).
// Building one copies the node's whole table and then detaches most of it, which grows
// with the sandboxes held (~10 ms at 3 000, holding the kernel's global namespace lock
// that every mount and unmount on the host takes), so a template lives long enough for
// that to be rare.
//
// A template holds references to the host's mounts it copied; where the host's mounts
// are private (no propagation, as on this project's test hosts) an unmount on the host
// does not reach the copies. So a template detaches, besides the data and netns
// directories, every mount that holds a device or a server others wait for: FUSE (a
// disk server's connection ends only once no mount is left), loop devices, overlays and
// namespace files, except those launches need (the root, and the mounts the data
// directory and the keep paths are on). What it still pins is ordinary filesystems for
// at most templateMaxAge. With private mounts the template also misses what the host
// mounts after it was built, so nothing a launch needs may come from there: a sandbox's
// own mounts are cloned in at launch (enter), and volumes are staged as mounts below the
// sandbox's directory (volumeMounts); the runtime's other sources (envd, resolv.conf)
// are files of the host that outlive templates.
const templateMaxAge = 30 * time.Second

// nsTemplate is a mount namespace launches start from.
type nsTemplate struct {
	fd    int // its nsfs file
	built time.Time
	users int  // launches between acquire and put
	stale bool // no longer handed out: closed when its last user is done
}

// The launcher's thread changes namespace and is never unlocked, so it must never be the
// main thread: /proc/self shows the main thread's namespace (the node's scans of
// /proc/self/mountinfo would see the launcher's), and Go cannot end the main thread, so
// it would stay in it. Locking the main goroutine to the main thread from an init
// function keeps every other goroutine off it (runtime.LockOSThread's documentation).
func init() { runtime.LockOSThread() }

// errMainThread means the launcher found itself on the main thread (see init).
var errMainThread = errors.New("oci: launcher on the main thread")

// onDiscardedThread runs fn on an OS thread of its own that is locked and never unlocked,
// so Go ends it when fn returns: fn may move it into other namespaces (and start
// processes there) without that thread serving any other goroutine afterwards. It returns
// errMainThread, without running fn, when that thread is the main thread (see init).
func onDiscardedThread(fn func() error) error {
	errc := make(chan error, 1)
	go func() {
		runtime.LockOSThread()
		if unix.Gettid() == unix.Getpid() {
			runtime.UnlockOSThread()
			errc <- errMainThread
			return
		}
		errc <- fn()
	}()
	return <-errc
}

// joinMountNS moves the calling thread into the mount namespace of process pid, at its
// root. Only for a thread that onDiscardedThread throws away afterwards or one of
// nsThreads, which brings it back: setns into a mount namespace needs a thread whose root
// and working directory are its own (Go's threads share them), so no other goroutine may
// run on it again.
func joinMountNS(pid int) error {
	ns, err := unix.Open(fmt.Sprintf("/proc/%d/ns/mnt", pid), unix.O_RDONLY|unix.O_CLOEXEC, 0)
	if err != nil {
		return fmt.Errorf("container's mount namespace: %w", err)
	}
	defer unix.Close(ns)
	if err := unix.Unshare(unix.CLONE_FS); err != nil {
		return fmt.Errorf("unshare fs: %w", err)
	}
	if err := unix.Setns(ns, unix.CLONE_NEWNS); err != nil {
		return fmt.Errorf("join the container's mount namespace: %w", err)
	}
	return nil
}

// errPrivateNS means the private namespace could not be set up; nothing was run.
var errPrivateNS = errors.New("oci: private mount namespace for the runtime")

// newLaunchNS returns the launcher for sandboxes below dir, making dir a mount point
// (a recursive bind onto itself, kept across restarts) when it is not one yet. A dir that
// is not a mount point but already holds mounts (sandboxes of a node that ran before
// this existed) cannot be made one without hiding them: it returns nil, logged, and the
// runtime runs in the node's namespace until a restart finds no mount below dir.
// cgroupView and cgroups are how the namespace leaves the runtime only the cgroup
// hierarchies sandboxes need (see launchNS.cgroups).
func newLaunchNS(dir, netnsDir string, keep []string, cgroupView bool, cgroups []string, log *slog.Logger) *launchNS {
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
	ns := &launchNS{root: dir, log: log, maxAge: templateMaxAge, cgroupView: cgroupView, cgroups: cgroups}
	for _, p := range keep {
		if p == "" {
			continue
		}
		if p, err := filepath.Abs(p); err == nil && p != "/" {
			ns.keep = append(ns.keep, p)
		}
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
		return runPolled(cmd)
	}
	err := onDiscardedThread(func() error {
		if err := ns.enter(dir, netns); err != nil {
			return fmt.Errorf("%w: %w", errPrivateNS, err)
		}
		// os/exec forks on this (locked) thread: the child inherits its namespace. The
		// wait needs no namespace, so the thread is discarded while the runtime runs.
		return cmd.Start()
	})
	if errors.Is(err, errMainThread) {
		return runPolled(cmd)
	}
	if errors.Is(err, errPrivateNS) {
		if !ns.off.Swap(true) {
			ns.log.Warn("oci: the runtime runs in the host's mount namespace from now on", "err", err)
		}
		return runPolled(cmd)
	}
	if err != nil {
		return err
	}
	return waitPolled(cmd)
}

// enter moves the calling (locked) thread into a new mount namespace, a copy of the
// current template, where the data directory holds only dir's mounts, the netns
// directory only netns, and the cgroup root only the hierarchies a sandbox needs.
func (ns *launchNS) enter(dir, netns string) error {
	dir = filepath.Clean(dir)
	if rel, err := filepath.Rel(ns.root, dir); err != nil || rel == "." || strings.HasPrefix(rel, "..") {
		return fmt.Errorf("%s is not below %s", dir, ns.root)
	}
	// The sandbox's own mounts (its root, volumes' staging binds), each cloned on its
	// own: cloning dir, a directory of the data directory's mount, made the kernel look
	// at every mount below the data directory, every sandbox's (is_subdir for each, ~1 ms
	// at 1 500 held). The rest of dir is the same directory in the template.
	paths, err := findMounts(dir, walkBudget)
	if err != nil {
		paths = []string{dir}
	}
	if netns != "" && ns.netnsDir != "" && filepath.Dir(filepath.Clean(netns)) == ns.netnsDir {
		paths = append(paths, filepath.Clean(netns))
	}
	trees := make([]int, 0, len(paths))
	defer func() {
		for _, fd := range trees {
			unix.Close(fd)
		}
	}()
	// Clone the sandbox's mounts while still in the node's namespace, where they are.
	for _, p := range paths {
		fd, err := unix.OpenTree(unix.AT_FDCWD, p, unix.OPEN_TREE_CLONE|unix.OPEN_TREE_CLOEXEC|unix.AT_RECURSIVE)
		if err != nil {
			return fmt.Errorf("clone %s: %w", p, err)
		}
		trees = append(trees, fd)
	}
	wd, err := os.Getwd()
	if err != nil {
		return fmt.Errorf("working directory: %w", err)
	}
	t, err := ns.acquire()
	if err != nil {
		return err
	}
	defer ns.put(t)
	// setns into a mount namespace needs a thread whose root and working directory
	// are its own (Go's threads share them).
	if err := unix.Unshare(unix.CLONE_FS); err != nil {
		return fmt.Errorf("unshare fs: %w", err)
	}
	if err := unix.Setns(t.fd, unix.CLONE_NEWNS); err != nil {
		return fmt.Errorf("enter the template: %w", err)
	}
	// A copy of the template, so this sandbox's mounts reach no other launch.
	if err := unix.Unshare(unix.CLONE_NEWNS); err != nil {
		return fmt.Errorf("unshare: %w", err)
	}
	// setns moved the thread to the namespace's root; runc is started from here.
	if err := unix.Chdir(wd); err != nil {
		return fmt.Errorf("back to %s: %w", wd, err)
	}
	for i, p := range paths {
		if err := unix.MoveMount(trees[i], "", unix.AT_FDCWD, p, unix.MOVE_MOUNT_F_EMPTY_PATH); err != nil {
			return fmt.Errorf("put %s in place: %w", p, err)
		}
		// A clone of a shared mount is a peer of the host's: make it a slave, so nothing
		// done below it here reaches the host, like everything else in the template.
		if err := unix.Mount("", p, "", unix.MS_SLAVE|unix.MS_REC, ""); err != nil {
			return fmt.Errorf("make %s a slave: %w", p, err)
		}
	}
	return nil
}

// acquire returns the current template, building one when there is none or it is older
// than ns.maxAge. The caller puts it back once it entered it (or gave up).
func (ns *launchNS) acquire() (*nsTemplate, error) {
	ns.mu.Lock()
	defer ns.mu.Unlock()
	if t := ns.tmpl; t != nil && time.Since(t.built) < ns.maxAge {
		t.users++
		return t, nil
	}
	fd, err := ns.buildTemplate()
	if err != nil {
		return nil, err
	}
	if old := ns.tmpl; old != nil {
		ns.retire(old)
	}
	t := &nsTemplate{fd: fd, built: time.Now(), users: 1}
	ns.tmpl = t
	time.AfterFunc(ns.maxAge, func() { ns.expire(t) })
	return t, nil
}

// put ends a launch's use of t.
func (ns *launchNS) put(t *nsTemplate) {
	ns.mu.Lock()
	defer ns.mu.Unlock()
	t.users--
	if t.stale && t.users == 0 {
		unix.Close(t.fd)
	}
}

// expire drops t if it is still the current template: its age is up, and a launch
// after this builds a new one.
func (ns *launchNS) expire(t *nsTemplate) {
	ns.mu.Lock()
	defer ns.mu.Unlock()
	if ns.tmpl == t {
		ns.tmpl = nil
		ns.retire(t)
	}
}

// retire stops handing t out; ns.mu is held.
func (ns *launchNS) retire(t *nsTemplate) {
	t.stale = true
	if t.users == 0 {
		unix.Close(t.fd)
	}
}

// buildTemplate makes a template namespace and returns its nsfs file: a copy of the
// node's, all slaves of the host's mounts (nothing done there reaches the host; unmounts
// and mounts on the host still propagate where the host's are shared), less the data
// directory, the netns directory and the cgroup hierarchies no sandbox needs. Each is
// detached: the directories below are the same ones (each mount is a bind of its own
// directory), now without any sandbox's mounts. The namespace is made on a thread of its
// own that ends with it (the returned file keeps it).
func (ns *launchNS) buildTemplate() (int, error) {
	type built struct {
		fd  int
		err error
	}
	c := make(chan built, 1)
	go func() {
		// Never unlocked: the thread ends with this goroutine, leaving its namespace.
		runtime.LockOSThread()
		if unix.Gettid() == unix.Getpid() {
			runtime.UnlockOSThread()
			c <- built{-1, errMainThread}
			return
		}
		fd, err := ns.makeTemplate()
		c <- built{fd, err}
	}()
	b := <-c
	if b.err != nil {
		return -1, fmt.Errorf("template: %w", b.err)
	}
	return b.fd, nil
}

// makeTemplate does buildTemplate's work on the calling (locked, disposable) thread.
func (ns *launchNS) makeTemplate() (int, error) {
	if err := unshareMountNS(); err != nil {
		return -1, err
	}
	detach := []string{ns.root}
	if ns.netnsDir != "" {
		detach = append(detach, ns.netnsDir)
	}
	for _, d := range detach {
		if err := unix.Unmount(d, unix.MNT_DETACH); err != nil {
			return -1, fmt.Errorf("detach %s: %w", d, err)
		}
	}
	if ns.cgroupView {
		if err := showCgroupMounts(cgroupRoot, ns.cgroups); err != nil {
			return -1, err
		}
	} else if err := hideCgroupMounts(ns.cgroups); err != nil {
		return -1, err
	}
	if err := detachHolders(append([]string{ns.root}, ns.keep...)); err != nil {
		return -1, err
	}
	fd, err := unix.Open("/proc/thread-self/ns/mnt", unix.O_RDONLY|unix.O_CLOEXEC, 0)
	if err != nil {
		return -1, fmt.Errorf("open its namespace: %w", err)
	}
	return fd, nil
}

// unshareMountNS moves the calling (locked, disposable) thread into a mount namespace of
// its own, a copy of its current one that the host's mounts and unmounts still reach
// (slave) and whose own changes never reach the host.
func unshareMountNS() error {
	if err := unix.Unshare(unix.CLONE_NEWNS); err != nil {
		return fmt.Errorf("unshare: %w", err)
	}
	if err := unix.Mount("", "/", "", unix.MS_SLAVE|unix.MS_REC, ""); err != nil {
		return fmt.Errorf("make / a slave: %w", err)
	}
	return nil
}

// detachHolders detaches, in the calling thread's mount namespace (a template's), every
// mount that holds something the host may want back while the template lives (see
// templateMaxAge): FUSE, loop devices, overlays and namespace files, but never the root
// nor a mount any of keep is on.
func detachHolders(keep []string) error {
	f, err := os.Open("/proc/thread-self/mountinfo")
	if err != nil {
		return fmt.Errorf("mountinfo: %w", err)
	}
	defer f.Close()
	infos, err := mountinfo.GetMountsFromReader(f, func(m *mountinfo.Info) (skip, stop bool) {
		return !holds(m) || m.Mountpoint == "/" || onPath(m.Mountpoint, keep), false
	})
	if err != nil {
		return fmt.Errorf("mountinfo: %w", err)
	}
	// Children before parents; a mount already gone with its parent answers EINVAL.
	for i := len(infos) - 1; i >= 0; i-- {
		err := unix.Unmount(infos[i].Mountpoint, unix.MNT_DETACH)
		if err != nil && !errors.Is(err, unix.EINVAL) && !errors.Is(err, unix.ENOENT) {
			return fmt.Errorf("detach %s: %w", infos[i].Mountpoint, err)
		}
	}
	return nil
}

// holds says whether mount m holds a server, a device or a namespace others wait for.
func holds(m *mountinfo.Info) bool {
	return m.FSType == "fuse" || m.FSType == "fuseblk" || strings.HasPrefix(m.FSType, "fuse.") ||
		m.FSType == "nsfs" || m.FSType == "overlay" || strings.HasPrefix(m.Source, "/dev/loop")
}

// onPath says whether mount point dir is one of paths or a directory above one.
func onPath(dir string, paths []string) bool {
	for _, p := range paths {
		if p == dir || strings.HasPrefix(p, dir+"/") {
			return true
		}
	}
	return false
}

// release unmounts the data directory's bind onto itself when nothing else is mounted
// below it (no sandbox kept running), so that a node that stops with none held leaves the
// host's mount table as it found it and its data directory removable. With sandboxes
// kept, the bind stays for the restart that adopts them.
func (ns *launchNS) release() error {
	if ns == nil {
		return nil
	}
	ns.mu.Lock()
	if t := ns.tmpl; t != nil {
		ns.tmpl = nil
		ns.retire(t)
	}
	ns.mu.Unlock()
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
