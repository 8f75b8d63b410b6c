package volume

import (
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"time"

	"golang.org/x/sys/unix"
)

// A volume made under a size quota (Options.SizeMB) is an ext4 filesystem in a sparse
// image file, <id>/image, loop-mounted at <id>/fs; its content is <id>/fs/data (the
// filesystem's root holds lost+found, which is not the user's). The kernel enforces the
// size for every writer at once (sandboxes, through their bind mounts, and the content
// API), which a directory on the node's shared filesystem cannot do without project
// quotas, and those need the data directory's filesystem mounted with them.
//
// The mount outlives the node process: sandboxes kept across a node restart hold it
// through their bind mounts, and mounting the image a second time (another loop device,
// another superblock on the same blocks) would corrupt it. Open therefore mounts only
// images that are not mounted yet (after a host reboot); Delete unmounts.

// MinSizeMB is the smallest quota: an ext4 filesystem with a journal fits, with room.
const MinSizeMB = 16

// ErrNoSpace means a write went beyond the volume's size quota (507, as E2B's
// NotEnoughSpaceError).
var ErrNoSpace = errors.New("volume is full")

// mkfsTimeout bounds mkfs.ext4 and mount; both take well under a second.
const mkfsTimeout = time.Minute

func (s *Store) imagePath(id string) string { return filepath.Join(s.dir, id, "image") }
func (s *Store) fsDir(id string) string     { return filepath.Join(s.dir, id, "fs") }

// makeImage creates and mounts the filesystem of a new quota'd volume in vdir.
func (s *Store) makeImage(id string, sizeMB int) error {
	img := s.imagePath(id)
	f, err := os.OpenFile(img, os.O_RDWR|os.O_CREATE|os.O_EXCL, 0o600)
	if err != nil {
		return err
	}
	err = f.Truncate(int64(sizeMB) << 20)
	if cerr := f.Close(); err == nil {
		err = cerr
	}
	if err != nil {
		return err
	}
	ctx, cancel := context.WithTimeout(context.Background(), mkfsTimeout)
	defer cancel()
	// -m 0: no blocks reserved for root (every byte is the user's); lazy init keeps the
	// image sparse and mkfs fast; root_owner: the kernel checks sandboxes' access to data/.
	out, err := exec.CommandContext(ctx, "mkfs.ext4", "-q", "-F", "-m", "0",
		"-E", "lazy_itable_init=1,lazy_journal_init=1,root_owner=0:0", img).CombinedOutput()
	if err != nil {
		return fmt.Errorf("mkfs.ext4: %w: %s", err, strings.TrimSpace(string(out)))
	}
	if err := os.Mkdir(s.fsDir(id), 0o711); err != nil {
		return err
	}
	if err := s.mountImage(ctx, id); err != nil {
		return err
	}
	data := filepath.Join(s.fsDir(id), "data")
	if err = os.Mkdir(data, 0o777); err == nil {
		err = os.Chmod(data, 0o777)
	}
	if err != nil {
		_ = s.unmountImage(id)
	}
	return err
}

// mountImage loop-mounts volume id's image at its fs directory unless it is mounted.
func (s *Store) mountImage(ctx context.Context, id string) error {
	mounted, err := isMountPoint(s.fsDir(id))
	if err != nil || mounted {
		return err
	}
	out, err := exec.CommandContext(ctx, "mount", "-t", "ext4", "-o", "loop,nodev,nosuid", s.imagePath(id), s.fsDir(id)).CombinedOutput()
	if err != nil {
		return fmt.Errorf("mount the image of volume %s: %w: %s", id, err, strings.TrimSpace(string(out)))
	}
	return nil
}

// unmountImage unmounts volume id's filesystem (lazily when something still holds it:
// the loop device goes with the last user) and is done when it is not mounted.
func (s *Store) unmountImage(id string) error {
	dir := s.fsDir(id)
	mounted, err := isMountPoint(dir)
	if err != nil || !mounted {
		return err
	}
	if err := unix.Unmount(dir, 0); err != nil {
		if err := unix.Unmount(dir, unix.MNT_DETACH); err != nil {
			return fmt.Errorf("unmount volume %s: %w", id, err)
		}
	}
	return nil
}

// isMountPoint reports whether dir is the root of a mount: its device differs from its
// parent's (a loop mount of a volume is never on the same device as the data dir).
func isMountPoint(dir string) (bool, error) {
	var st, parent unix.Stat_t
	if err := unix.Lstat(dir, &st); err != nil {
		if errors.Is(err, unix.ENOENT) {
			return false, nil // a volume without a quota has no fs directory
		}
		return false, fmt.Errorf("volume: %w", err)
	}
	if err := unix.Lstat(filepath.Dir(dir), &parent); err != nil {
		return false, fmt.Errorf("volume: %w", err)
	}
	return st.Dev != parent.Dev, nil
}
