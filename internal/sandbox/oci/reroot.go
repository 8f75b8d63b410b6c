package oci

import (
	"context"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"slices"
	"sort"
	"strings"
	"time"

	"github.com/aenv-dev/aenv/internal/sandbox"
	"github.com/moby/sys/mountinfo"
	"golang.org/x/sys/unix"
)

// Blank warm containers.
//
// A template's warm containers are created on its root, so they serve creates of that
// template only. A fork's children, a resume from disk and a create from a snapshot
// that is not a template each launch a root that exists once, after the request came:
// nothing could be created for it in advance, and every child paid the runtime's whole
// start (runc, runc init, the hook, envd's start: ~45 ms of CPU each) on its path. So did
// a template's creates beyond what its pool held (its first burst, and bursts that come
// faster than the pool refills).
//
// A blank warm container is created (and its envd started) on blankRoot, a read-only
// skeleton shared by all of them that holds only the mount points of the spec's mounts.
// It serves any block root: the root is mounted on the host as for a fresh container,
// then moved into the container's mount namespace, the container's mounts (/proc, /dev,
// /sys, envd, resolv.conf with everything below them) are moved onto it, and the
// namespace's root is pivoted to it, which moves envd's root and working directory too
// (pivot_root changes every task of the namespace whose root is the old one). The
// skeleton is then detached. What the container is after that is what runc would have
// built on that root: the same mounts, namespaces, cgroup, capabilities and seccomp
// filter, all of which runc set up before its init ran and none of which depend on the
// root's files.
//
// Blank containers are one more pool (blankKey), wanted by the launches that took or
// missed one: those without a pool of their own, and template launches that found their
// template's pool empty.

// blankRootName is the skeleton's directory under the data directory.
const blankRootName = "blankroot"

// stageDir is where a new root is attached in a blank container before the pivot (a
// directory of the skeleton).
const stageDir = "/.aenv/root"

// blankKey names the blank containers in the warm pool (root keys of templates are
// directories or start with "layers:").
const blankKey = "blank"

// blankDirs and blankFiles are the skeleton's mount points: the spec's mount
// destinations directly on the root (the others are below /proc, /dev or /sys and exist
// in those filesystems) and stageDir.
var (
	blankDirs  = []string{"/proc", "/dev", "/sys", "/etc", "/.aenv", stageDir}
	blankFiles = []string{envdMount, "/etc/resolv.conf"}
)

// makeBlankRoot creates (or checks) the skeleton under dataDir and returns its path. Its
// directories and files belong to the host's root and cannot be written by anything in a
// sandbox (whose ids map to other host ids), and no sandbox sees it once rerooted.
func makeBlankRoot(dataDir string) (string, error) {
	root := filepath.Join(dataDir, blankRootName)
	if err := os.MkdirAll(root, 0o755); err != nil {
		return "", fmt.Errorf("oci: blank root: %w", err)
	}
	for _, d := range blankDirs {
		if err := os.MkdirAll(filepath.Join(root, d), 0o555); err != nil {
			return "", fmt.Errorf("oci: blank root: %w", err)
		}
	}
	for _, f := range blankFiles {
		fh, err := os.OpenFile(filepath.Join(root, f), os.O_CREATE|os.O_RDONLY, 0o444)
		if err != nil {
			return "", fmt.Errorf("oci: blank root: %w", err)
		}
		fh.Close()
	}
	return root, nil
}

// errNoMountPoint means a root lacks a mount point the container's mounts need; a blank
// container cannot be moved onto it (runc would have created it).
var errNoMountPoint = errors.New("oci: root lacks a mount point")

// checkMountPoints checks that the root mounted at dir (on the host) has the mount points
// of a sandbox's top-level mounts, of the right kind, and returns them. No component of
// their paths may be a symbolic link: the root's files are the sandbox's (a fork's
// source wrote them), and a link would send a mount elsewhere when it is moved in.
// Nothing runs on the root yet, so what is checked here is what the move finds.
func checkMountPoints(dir string, resolvConf bool) ([]string, error) {
	want := map[string]bool{"/proc": true, "/dev": true, "/sys": true, envdMount: false}
	if resolvConf {
		want["/etc/resolv.conf"] = false
	}
	paths := make([]string, 0, len(want))
	for p, isDir := range want {
		paths = append(paths, p)
		var fi fs.FileInfo
		cur := dir
		for _, c := range strings.Split(strings.TrimPrefix(p, "/"), "/") {
			cur = filepath.Join(cur, c)
			var err error
			if fi, err = os.Lstat(cur); err != nil {
				return nil, fmt.Errorf("%w: %s: %w", errNoMountPoint, p, err)
			}
			if fi.Mode()&fs.ModeSymlink != 0 {
				return nil, fmt.Errorf("%w: %s: %s is a symbolic link", errNoMountPoint, p, c)
			}
		}
		if fi.IsDir() != isDir {
			return nil, fmt.Errorf("%w: %s is a %s", errNoMountPoint, p, fi.Mode().Type())
		}
	}
	sort.Strings(paths)
	return paths, nil
}

// reroot moves the mount namespace of the container whose init is pid from the blank
// root onto the filesystem mounted at newRoot in the node's namespace (see above), with
// its mounts at points (checked by checkMountPoints; a mount elsewhere is an error). It
// runs on a thread that joins the container's namespace: one of b.nsThreads, which comes
// back, or one of its own that ends there.
func (b *Backend) reroot(pid int, newRoot string, points []string) error {
	fn := func() error { return rerootThread(pid, newRoot, points) }
	var err error
	if b.nsThreads != nil {
		err = b.nsThreads.run(fn)
	} else {
		err = onDiscardedThread(fn)
	}
	if err != nil {
		return fmt.Errorf("oci: move container onto its root: %w", err)
	}
	return nil
}

func rerootThread(pid int, newRoot string, points []string) error {
	// Cloned here, where the root is mounted; the clone keeps the id mapping.
	tree, err := unix.OpenTree(unix.AT_FDCWD, newRoot, unix.OPEN_TREE_CLONE|unix.OPEN_TREE_CLOEXEC)
	if err != nil {
		return fmt.Errorf("clone %s: %w", newRoot, err)
	}
	defer unix.Close(tree)
	tops, err := topMounts(pid)
	if err != nil {
		return err
	}
	for _, m := range tops {
		if !slices.Contains(points, m) {
			return fmt.Errorf("the container has a mount at %s, which the root was not checked for", m)
		}
	}
	if err := joinMountNS(pid); err != nil {
		return err
	}
	if err := unix.MoveMount(tree, "", unix.AT_FDCWD, stageDir, unix.MOVE_MOUNT_F_EMPTY_PATH); err != nil {
		return fmt.Errorf("attach the root: %w", err)
	}
	// pivot_root refuses a shared new root; a clone of a shared host mount is one.
	if err := unix.Mount("", stageDir, "", unix.MS_PRIVATE, ""); err != nil {
		return fmt.Errorf("make the root private: %w", err)
	}
	for _, m := range tops {
		if err := unix.MoveMount(unix.AT_FDCWD, m, unix.AT_FDCWD, stageDir+m, 0); err != nil {
			return fmt.Errorf("move %s: %w", m, err)
		}
	}
	old, err := unix.Open("/", unix.O_DIRECTORY|unix.O_RDONLY|unix.O_CLOEXEC, 0)
	if err != nil {
		return fmt.Errorf("open the blank root: %w", err)
	}
	defer unix.Close(old)
	if err := unix.Chdir(stageDir); err != nil {
		return fmt.Errorf("enter the root: %w", err)
	}
	// The old root ends up on top of the new one, where it is detached from (runc's way).
	if err := unix.PivotRoot(".", "."); err != nil {
		return fmt.Errorf("pivot_root: %w", err)
	}
	if err := unix.Fchdir(old); err != nil {
		return fmt.Errorf("back to the blank root: %w", err)
	}
	if err := unix.Unmount(".", unix.MNT_DETACH); err != nil {
		return fmt.Errorf("detach the blank root: %w", err)
	}
	return nil
}

// topMounts lists the mount points directly on the root mount of process pid, as it
// sees them (read from the node's /proc: the container's shows only its own pids).
func topMounts(pid int) ([]string, error) {
	f, err := os.Open(fmt.Sprintf("/proc/%d/mountinfo", pid))
	if err != nil {
		return nil, fmt.Errorf("mount table: %w", err)
	}
	defer f.Close()
	all, err := mountinfo.GetMountsFromReader(f, nil)
	if err != nil {
		return nil, fmt.Errorf("mount table: %w", err)
	}
	root := -1
	for _, m := range all {
		if m.Mountpoint == "/" {
			root = m.ID // the last one listed is on top
		}
	}
	var out []string
	for _, m := range all {
		if m.Parent == root && m.ID != root && m.Mountpoint != "/" && m.Mountpoint != stageDir {
			out = append(out, m.Mountpoint)
		}
	}
	if root < 0 || len(out) == 0 {
		return nil, fmt.Errorf("mount table: no mounts on the root (root mount %d)", root)
	}
	sort.Strings(out)
	return out, nil
}

// startBlank mounts root for blank warm container w as launchNew would for a container
// of its own, moves w onto it and claims it for plan. On error w is left to be stopped.
func (b *Backend) startBlank(ctx context.Context, w *Instance, plan sandbox.LaunchPlan, root createOpts) error {
	t0 := time.Now()
	pid, err := b.moveBlank(ctx, w, root)
	if err != nil {
		return err
	}
	t1 := time.Now()
	if err := b.claimWarm(ctx, w, pid, plan); err != nil {
		return err
	}
	b.log.Debug("oci: blank container moved onto its root", "id", plan.SandboxID, "cid", w.cid,
		"move", t1.Sub(t0), "claim", time.Since(t1))
	return nil
}

// moveBlank mounts root for blank warm container w and moves w onto it; it returns the
// container's init pid. Until claimWarm saves the state, w is recorded as a warm container,
// so a node that dies in between removes it (and its root) at the restart.
func (b *Backend) moveBlank(ctx context.Context, w *Instance, root createOpts) (int, error) {
	pid, err := b.warmPID(w)
	if err != nil {
		return 0, err
	}
	userns := -1
	if w.idmap != nil {
		if userns, err = b.initUserns(pid, *w.idmap); err != nil {
			return 0, err
		}
		defer unix.Close(userns)
	}
	if err := b.mountBlock(ctx, w, root, userns); err != nil {
		return 0, err
	}
	points, err := checkMountPoints(w.l.rootfs(), b.cfg.ResolvConf != "")
	if err != nil {
		return 0, err
	}
	return pid, b.reroot(pid, w.l.rootfs(), points)
}
