package oci

import (
	"crypto/rand"
	"fmt"
	"os"

	"golang.org/x/sys/unix"
)

// bootIDPath is the kernel's per-boot id: a fresh sandbox (new processes, as after a
// reboot) sees a new one; one thawed from a freeze keeps it.
const bootIDPath = "/proc/sys/kernel/random/boot_id"

// writeBootID writes a fresh random boot id (the kernel's UUID form) into path.
func writeBootID(path string) error {
	b := make([]byte, 16)
	if _, err := rand.Read(b); err != nil {
		return err
	}
	b[6] = b[6]&0x0f | 0x40
	b[8] = b[8]&0x3f | 0x80
	id := fmt.Sprintf("%x-%x-%x-%x-%x\n", b[0:4], b[4:6], b[6:8], b[8:10], b[10:16])
	return os.WriteFile(path, []byte(id), 0o444)
}

// bindBootID binds host file src, read-only, over the boot id in the mount namespace of
// the created container whose init is pid (blocked before it runs anything of the
// sandbox's). runc only lets a few lxcfs files be mounted under /proc, so the spec cannot
// say it; a createContainer hook could, but runs a process (`mount`) per container. This
// is a clone of src attached from a node thread that joins the namespace, as reroot does.
func bindBootID(pid int, src string) error {
	err := onDiscardedThread(func() error {
		tree, err := unix.OpenTree(unix.AT_FDCWD, src, unix.OPEN_TREE_CLONE|unix.OPEN_TREE_CLOEXEC)
		if err != nil {
			return fmt.Errorf("clone %s: %w", src, err)
		}
		defer unix.Close(tree)
		attr := unix.MountAttr{Attr_set: unix.MOUNT_ATTR_RDONLY | unix.MOUNT_ATTR_NOSUID | unix.MOUNT_ATTR_NODEV | unix.MOUNT_ATTR_NOEXEC}
		if err := unix.MountSetattr(tree, "", unix.AT_EMPTY_PATH, &attr); err != nil {
			return fmt.Errorf("make it read-only: %w", err)
		}
		if err := joinMountNS(pid); err != nil {
			return err
		}
		if err := unix.MoveMount(tree, "", unix.AT_FDCWD, bootIDPath, unix.MOVE_MOUNT_F_EMPTY_PATH); err != nil {
			return fmt.Errorf("attach it: %w", err)
		}
		return nil
	})
	if err != nil {
		return fmt.Errorf("oci: boot id: %w", err)
	}
	return nil
}
