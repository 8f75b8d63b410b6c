package oci

import (
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"syscall"

	"github.com/aenv-dev/aenv/internal/rootfs"
	"golang.org/x/sys/unix"
)

// idMap maps sandbox ids 0..Size-1 to host ids HostID..HostID+Size-1 (uid and gid alike).
type idMap struct {
	HostID uint32 `json:"hostID"`
	Size   uint32 `json:"size"`
}

// mapLine is m as a line of /proc/<pid>/uid_map and gid_map (fields as the kernel
// prints them, less its padding).
func (m idMap) mapLine() string { return fmt.Sprintf("0 %d %d", m.HostID, m.Size) }

// rootID is the host id of the sandbox's root under m, or -1 without a map (no user
// namespace).
func (m *idMap) rootID() int {
	if m == nil {
		return -1
	}
	return int(m.HostID)
}

// usernsFD creates a user namespace with the mapping m and returns an fd to it; the
// namespace lives as long as the fd. A short-lived child holds it while we open it, because
// Go cannot unshare a user namespace in a multithreaded process.
//
// The child is made with CLONE_VFORK|CLONE_VM beside CLONE_NEWUSER: it runs in the node's
// memory until it execs, as every other child of the node does. Go adds those two flags
// itself only without CLONE_NEWUSER (its child then waits for id maps that a vfork parent,
// blocked until the exec, could not write), and passes Cloneflags through as they are; so
// with no maps in SysProcAttr the child execs at once, and the maps are written here after
// it, which a process with CAP_SETUID and CAP_SETGID above the namespace may do. A plain
// fork copied the page tables of this large process (~1.4 ms of CPU with a few sandboxes
// held, ~2.8 ms at 1 500), and every page the node wrote afterwards took a copy-on-write
// fault: ~12 % of the node's CPU in a fill at 1 000 held (copy-on-write faults 7 %,
// the fork and its TLB shootdowns 5 %).
func usernsFD(m idMap) (int, error) {
	sleep, err := exec.LookPath("sleep")
	if err != nil {
		return -1, fmt.Errorf("oci: user namespace helper needs sleep(1): %w", err)
	}
	cmd := exec.Command(sleep, "3600")
	cmd.SysProcAttr = &syscall.SysProcAttr{
		Cloneflags: syscall.CLONE_NEWUSER | syscall.CLONE_VFORK | syscall.CLONE_VM,
		Pdeathsig:  syscall.SIGKILL,
	}
	if err := cmd.Start(); err != nil {
		return -1, fmt.Errorf("oci: user namespace helper: %w", err)
	}
	defer func() {
		_ = cmd.Process.Kill()
		_ = cmd.Wait()
	}()
	pid := cmd.Process.Pid
	line := []byte(m.mapLine() + "\n")
	for _, f := range []string{"uid_map", "gid_map"} {
		if err := os.WriteFile(fmt.Sprintf("/proc/%d/%s", pid, f), line, 0); err != nil {
			return -1, fmt.Errorf("oci: user namespace %s: %w", f, err)
		}
	}
	fd, err := unix.Open(fmt.Sprintf("/proc/%d/ns/user", pid), unix.O_RDONLY|unix.O_CLOEXEC, 0)
	if err != nil {
		return -1, fmt.Errorf("oci: open user namespace: %w", err)
	}
	return fd, nil
}

// idmappedBind bind-mounts src at dst with ownership shifted by the user namespace usernsFd
// (host id 0 appears as the namespace's root), so a shared template directory owned by host
// root is owned by root inside a user-namespaced sandbox without copying or chowning it.
func idmappedBind(src, dst string, userns int) error {
	return idmappedBindAttr(src, dst, userns, unix.MOUNT_ATTR_IDMAP|unix.MOUNT_ATTR_RDONLY)
}

// idmappedBindAttr is idmappedBind with the mount attributes set (MOUNT_ATTR_IDMAP, plus
// MOUNT_ATTR_RDONLY for a read-only view); with none set it is a plain recursive bind.
func idmappedBindAttr(src, dst string, userns int, set uint64) error {
	fd, err := unix.OpenTree(unix.AT_FDCWD, src, unix.OPEN_TREE_CLONE|unix.OPEN_TREE_CLOEXEC|unix.AT_RECURSIVE)
	if err != nil {
		return fmt.Errorf("oci: open_tree %s: %w", src, err)
	}
	defer unix.Close(fd)
	if set != 0 {
		attr := &unix.MountAttr{Attr_set: set, Userns_fd: uint64(userns)}
		if err := unix.MountSetattr(fd, "", unix.AT_EMPTY_PATH|unix.AT_RECURSIVE, attr); err != nil {
			return fmt.Errorf("oci: idmap %s: %w", src, err)
		}
	}
	if err := unix.MoveMount(fd, "", unix.AT_FDCWD, dst, unix.MOVE_MOUNT_F_EMPTY_PATH); err != nil {
		return fmt.Errorf("oci: move_mount %s: %w", dst, err)
	}
	return nil
}

// layout is a sandbox's directory under the data dir.
type layout struct{ dir string }

func (l layout) upper() string  { return filepath.Join(l.dir, "upper") }
func (l layout) work() string   { return filepath.Join(l.dir, "work") }
func (l layout) lower() string  { return filepath.Join(l.dir, "lower") } // idmapped view of the template
func (l layout) rootfs() string { return filepath.Join(l.dir, "rootfs") }
func (l layout) state() string  { return filepath.Join(l.dir, "state.json") }
func (l layout) log() string    { return filepath.Join(l.dir, "init.log") }
func (l layout) pid() string    { return filepath.Join(l.dir, "init.pid") }

// mountRootfs mounts the overlay: the template (idmapped when userns >= 0) as the read-only
// lower, and a per-sandbox upper owned by the sandbox's root so its writes never reach the
// template or another sandbox.
func mountRootfs(l layout, lowerDir string, m *idMap, userns int) error {
	for _, d := range []string{l.upper(), l.work(), l.rootfs()} {
		if err := os.MkdirAll(d, 0o755); err != nil {
			return fmt.Errorf("oci: mkdir %s: %w", d, err)
		}
	}
	lower := lowerDir
	if m != nil {
		if err := os.MkdirAll(l.lower(), 0o755); err != nil {
			return fmt.Errorf("oci: mkdir %s: %w", l.lower(), err)
		}
		if err := idmappedBind(lowerDir, l.lower(), userns); err != nil {
			return err
		}
		lower = l.lower()
		// The upper's root directory carries the rootfs root's ownership.
		for _, d := range []string{l.upper(), l.work()} {
			if err := os.Chown(d, int(m.HostID), int(m.HostID)); err != nil {
				return fmt.Errorf("oci: chown %s: %w", d, err)
			}
		}
	}
	opts := fmt.Sprintf("lowerdir=%s,upperdir=%s,workdir=%s", rootfs.EscapeOverlay(lower), rootfs.EscapeOverlay(l.upper()), rootfs.EscapeOverlay(l.work()))
	if err := unix.Mount("overlay", l.rootfs(), "overlay", 0, opts); err != nil {
		return fmt.Errorf("oci: mount overlay on %s: %w", l.rootfs(), err)
	}
	return nil
}
