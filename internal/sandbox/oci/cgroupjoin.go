package oci

import (
	"bytes"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strings"
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

// unneededCgroupMounts returns the cgroup hierarchies mounted directly below root in a
// mountinfo table that hold none of keep: v1 hierarchies of other controllers, named
// ones (name=systemd) and, on a hybrid host (when some v1 hierarchy holds one of keep),
// the unified tree. A host whose root is itself the unified tree (pure v2) has none:
// there a container is one cgroup whatever the controllers.
func unneededCgroupMounts(table []byte, root string, keep []string) []string {
	root = filepath.Clean(root)
	var v1Kept bool
	var drop, unified []string
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
				v1Kept = true
			} else {
				drop = append(drop, mp)
			}
		}
	}
	if !v1Kept {
		// Nothing to put the sandbox in with these controllers: leave the host as it is
		// rather than have the runtime find no hierarchy at all.
		return nil
	}
	return append(drop, unified...)
}

// hostUnneededCgroupMounts is unneededCgroupMounts for this host's cgroup root, or nil
// on a pure cgroup v2 host or when the table cannot be read.
func hostUnneededCgroupMounts() ([]string, error) {
	if unifiedOnly() {
		return nil, nil
	}
	raw, err := os.ReadFile("/proc/self/mountinfo")
	if err != nil {
		return nil, fmt.Errorf("oci: mountinfo: %w", err)
	}
	return unneededCgroupMounts(raw, cgroupRoot, sandboxControllers), nil
}

// hideCgroupMounts detaches paths (cgroup hierarchies) from the calling thread's mount
// namespace, which must be a private one that does not propagate to the host: the
// runtime started from it sees only the hierarchies left, so it neither makes the
// sandbox a cgroup in the others nor mounts them in the container. A path that is no
// longer a mount point is skipped.
func hideCgroupMounts(paths []string) error { return detachAll(paths) }
