package rootfs

import (
	"context"
	"errors"
	"fmt"
	"path/filepath"

	"github.com/aenv-dev/aenv/internal/storage/blockdev"
	"golang.org/x/sys/unix"
)

// Sweep removes what a crashed process left of block roots whose files lie under root:
// blockdev.SweepLoops aborts their FUSE connections (the server died with the process, and
// anything that touched the roots would wait for it forever), lazily unmounts their ext4
// filesystems, detaches their loop devices and unmounts FUSE; then the loop devices'
// writeback limits are put back (loop devices are reused). Call it at startup, after
// killing the processes that used the roots. Roots whose directory is in keep (adopted,
// their disks served by the data plane) are left alone.
func Sweep(ctx context.Context, root string, keep ...string) error {
	root, err := filepath.Abs(root)
	if err != nil {
		return fmt.Errorf("rootfs: sweep: %w", err)
	}
	loops, err := blockdev.SweepLoops(ctx, root, keep...)
	errs := []error{err, sweepExpedited(root)}
	for _, dev := range loops {
		var st unix.Stat_t
		if err := unix.Stat(dev, &st); err != nil {
			continue
		}
		errs = append(errs, resetDirty(fmt.Sprintf("/sys/class/bdi/%d:%d", unix.Major(st.Rdev), unix.Minor(st.Rdev))))
	}
	return errors.Join(errs...)
}
