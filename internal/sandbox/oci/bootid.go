package oci

import (
	"crypto/rand"
	"fmt"

	"github.com/aenv-dev/aenv/internal/rootfs"
	"golang.org/x/sys/unix"
)

// bootIDPath is the kernel's per-boot id: a fresh sandbox (new processes, as after a
// reboot) sees a new one; one thawed from a freeze keeps it.
const bootIDPath = "/proc/sys/kernel/random/boot_id"

// bootIDSource is the name of the boot id's source in the container's /dev while it is
// bound; nothing of the sandbox's runs before it is removed.
const bootIDSource = ".aenv-boot_id"

// newBootID returns a fresh random boot id in the kernel's UUID form.
func newBootID() ([]byte, error) {
	b := make([]byte, 16)
	if _, err := rand.Read(b); err != nil {
		return nil, err
	}
	b[6] = b[6]&0x0f | 0x40
	b[8] = b[8]&0x3f | 0x80
	return fmt.Appendf(nil, "%x-%x-%x-%x-%x\n", b[0:4], b[4:6], b[6:8], b[8:10], b[10:16]), nil
}

// bindBootID binds a fresh boot id, read-only, over the boot id in the mount namespace
// of the created container whose init is pid (blocked before it runs anything of the
// sandbox's). runc only lets a few lxcfs files be mounted under /proc, so the spec cannot
// say it; a createContainer hook could, but runs a process (`mount`) per container. This
// is a clone attached from a node thread that joins the namespace, as reroot does.
//
// The id is written to a file of the container's own /dev (a tmpfs of a few mounts),
// cloned from there and unlinked: cloning one file makes the kernel check every mount on
// the file's mount (has_locked_children), and a file of the bundle directory is on the
// data directory's, which holds every sandbox's root (~1 ms of the node's CPU per create
// at 3 000 held). rootID is the host id of the container's root (-1: no user namespace),
// as whom the file is made: that /dev belongs to the container's user namespace, where
// the host's root is not mapped (EOVERFLOW).
func bindBootID(pid, rootID int) error {
	id, err := newBootID()
	if err != nil {
		return fmt.Errorf("oci: boot id: %w", err)
	}
	err = onDiscardedThread(func() error {
		if err := joinMountNS(pid); err != nil {
			return err
		}
		dev, err := unix.Open("/dev", unix.O_RDONLY|unix.O_DIRECTORY|unix.O_CLOEXEC, 0)
		if err != nil {
			return fmt.Errorf("its source: %w", err)
		}
		defer unix.Close(dev)
		if err := writeAs(dev, bootIDSource, id, rootID); err != nil {
			return fmt.Errorf("its source: %w", err)
		}
		defer unix.Unlinkat(dev, bootIDSource, 0) // the bind keeps the file
		tree, err := unix.OpenTree(dev, bootIDSource, unix.OPEN_TREE_CLONE|unix.OPEN_TREE_CLOEXEC)
		if err != nil {
			return fmt.Errorf("clone its source: %w", err)
		}
		defer unix.Close(tree)
		attr := unix.MountAttr{Attr_set: unix.MOUNT_ATTR_RDONLY | unix.MOUNT_ATTR_NOSUID | unix.MOUNT_ATTR_NODEV | unix.MOUNT_ATTR_NOEXEC}
		if err := unix.MountSetattr(tree, "", unix.AT_EMPTY_PATH, &attr); err != nil {
			return fmt.Errorf("make it read-only: %w", err)
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

// writeAs creates name in directory dir with data, read-only, as host id id (fsuid and
// fsgid; the file system's user namespace maps only the container's ids) when id >= 0,
// capabilities kept (a blank container's /dev is 0555, not writable by its owner). The
// calling thread must be locked (onDiscardedThread's).
func writeAs(dir int, name string, data []byte, id int) error {
	write := func() error {
		fd, err := unix.Openat(dir, name, unix.O_WRONLY|unix.O_CREAT|unix.O_EXCL|unix.O_CLOEXEC, 0o444)
		if err != nil {
			return err
		}
		_, err = unix.Write(fd, data)
		if cerr := unix.Close(fd); err == nil {
			err = cerr
		}
		return err
	}
	if id < 0 {
		return write()
	}
	// The thread is thrown away afterwards, restored or not.
	_, err := rootfs.AsOwner(id, write)
	return err
}
