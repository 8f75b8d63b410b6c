package oci

import (
	"bytes"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strings"

	"golang.org/x/sys/unix"
)

// sandboxControllers are the cgroup v1 controllers a sandbox's cgroup is needed in: the
// limits the spec sets (devices, cpu, memory, pids), the counters Stats reads (cpuacct,
// memory, pids) and pause (freezer). runc's v1 manager puts a container in every
// hierarchy it finds mounted, so on a hybrid host a sandbox was a cgroup in all ten (the
// v1 ones, systemd's named one and the unified tree without controllers): 147 kernfs
// files and directories, a cgroup subsystem state per controller (cpuset's masks,
// blkio's per-device groups and stats, the unified tree's pressure tracking) and, in
// the container's cgroup namespace, a superblock per hierarchy for its /sys/fs/cgroup.
// None of the others carries a limit we set, so a sandbox left in their root cgroup
// loses nothing (no I/O, cpuset or hugetlb limit is configured anywhere).
var sandboxControllers = []string{"cpu", "cpuacct", "memory", "pids", "devices", "freezer"}

// splitCgroupMounts sorts the cgroup hierarchies mounted directly below root in a
// mountinfo table: need are the v1 ones that hold any of keep, rest the others (v1
// hierarchies of other controllers, named ones such as name=systemd, the unified tree).
// Both are nil on a host whose root is itself the unified tree (pure v2: there a
// container is one cgroup whatever the controllers) and where no hierarchy holds one of
// keep (nothing to put the sandbox in: leave the host as it is rather than have the
// runtime find no hierarchy at all).
func splitCgroupMounts(table []byte, root string, keep []string) (need, rest []string) {
	root = filepath.Clean(root)
	var unified []string
	for _, line := range bytes.Split(table, []byte{'\n'}) {
		pre, post, ok := bytes.Cut(line, []byte(" - "))
		if !ok {
			continue
		}
		f, g := strings.Fields(string(pre)), strings.Fields(string(post))
		if len(f) < 5 || len(g) < 3 {
			continue
		}
		mp, ok := unescapeMountinfo(f[4])
		if !ok || filepath.Dir(mp) != root {
			continue
		}
		switch g[0] {
		case "cgroup2":
			unified = append(unified, mp)
		case "cgroup":
			if slices.ContainsFunc(strings.Split(g[2], ","), func(o string) bool { return slices.Contains(keep, o) }) {
				need = append(need, mp)
			} else {
				rest = append(rest, mp)
			}
		}
	}
	if len(need) == 0 {
		return nil, nil
	}
	return need, append(rest, unified...)
}

// hostCgroupMounts is splitCgroupMounts for this host's cgroup root and the controllers
// sandboxes need; nil on a pure cgroup v2 host.
func hostCgroupMounts() (need, rest []string, err error) {
	if unifiedOnly() {
		return nil, nil, nil
	}
	raw, err := os.ReadFile("/proc/self/mountinfo")
	if err != nil {
		return nil, nil, fmt.Errorf("oci: mountinfo: %w", err)
	}
	need, rest = splitCgroupMounts(raw, cgroupRoot, sandboxControllers)
	return need, rest, nil
}

// hideCgroupMounts detaches paths (cgroup hierarchies) from the calling thread's mount
// namespace, which must be a private one that does not propagate to the host: runc
// started from there sees only the hierarchies left, so it neither makes the sandbox a
// cgroup in the others nor mounts them in the container. A path that is no longer a
// mount point is skipped. (runc still makes the sandbox's directories in the host's
// tmpfs below the detached mount points, where a hierarchy's parent directory exists;
// it removes them on delete.)
func hideCgroupMounts(paths []string) error { return detachAll(paths) }

// showCgroupMounts replaces, in the calling thread's mount namespace (a private one
// that does not propagate to the host), the cgroup root by a read-only tmpfs that holds
// only the hierarchies at paths: crun started from there sees no other, so it neither
// makes the sandbox a cgroup in them nor mounts them in the container. Detaching the
// others (hideCgroupMounts, runc's way) is not enough for crun, whose v1 manager takes
// the controllers from /proc/self/cgroup and, finding their directory still there (the
// host's tmpfs), fails on the missing cpuset files; on a read-only root the directory
// cannot be made, which it takes as "not mounted". No unified tree is left either,
// which crun 1.8 refuses beside v1 hierarchies when it holds a controller (hybrid
// hosts). runc, the other way round, fails where a hierarchy's directory is missing.
// Nothing is done for no paths.
func showCgroupMounts(root string, paths []string) error {
	if len(paths) == 0 {
		return nil
	}
	trees := make([]int, 0, len(paths))
	defer func() {
		for _, fd := range trees {
			unix.Close(fd)
		}
	}()
	for _, p := range paths {
		fd, err := unix.OpenTree(unix.AT_FDCWD, p, unix.OPEN_TREE_CLONE|unix.OPEN_TREE_CLOEXEC)
		if err != nil {
			return fmt.Errorf("clone the cgroup hierarchy %s: %w", p, err)
		}
		trees = append(trees, fd)
	}
	if err := unix.Mount("cgroup-view", root, "tmpfs", unix.MS_NOSUID|unix.MS_NODEV|unix.MS_NOEXEC, "mode=755,size=64k"); err != nil {
		return fmt.Errorf("mount a tmpfs on %s: %w", root, err)
	}
	for i, p := range paths {
		if err := os.Mkdir(p, 0o755); err != nil {
			return fmt.Errorf("cgroup view: %w", err)
		}
		if err := unix.MoveMount(trees[i], "", unix.AT_FDCWD, p, unix.MOVE_MOUNT_F_EMPTY_PATH); err != nil {
			return fmt.Errorf("cgroup view: attach %s: %w", p, err)
		}
	}
	flags := uintptr(unix.MS_REMOUNT | unix.MS_RDONLY | unix.MS_NOSUID | unix.MS_NODEV | unix.MS_NOEXEC)
	if err := unix.Mount("", root, "", flags, ""); err != nil {
		return fmt.Errorf("cgroup view: make %s read-only: %w", root, err)
	}
	return nil
}
