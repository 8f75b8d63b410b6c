package blockdev

import (
	"errors"
	"fmt"
	"os"

	"golang.org/x/sys/unix"
)

// FIFREEZE and FITHAW from linux/fs.h (_IOWR('X', 119/120, int)).
const (
	fiFreeze = 0xC0045877
	fiThaw   = 0xC0045878
)

// Freeze quiesces the filesystem mounted at dir (fsfreeze): dirty data is
// written through the loop device and the FUSE file down to the device and
// synced, and new writes block until thaw is called. Freeze, then
// Stack.SealAndRestack, then thaw gives a consistent snapshot of a mounted
// filesystem.
func Freeze(dir string) (thaw func() error, err error) {
	f, err := os.Open(dir)
	if err != nil {
		return nil, fmt.Errorf("blockdev: freeze: %w", err)
	}
	if err := unix.IoctlSetInt(int(f.Fd()), fiFreeze, 0); err != nil {
		f.Close()
		return nil, fmt.Errorf("blockdev: freeze %s: %w", dir, err)
	}
	return func() error {
		defer f.Close()
		if err := unix.IoctlSetInt(int(f.Fd()), fiThaw, 0); err != nil {
			return fmt.Errorf("blockdev: thaw %s: %w", dir, err)
		}
		return nil
	}, nil
}

// Thaw thaws the filesystem mounted at dir if it is frozen (a process that froze it died
// before thawing); one that is not frozen is fine.
func Thaw(dir string) error {
	f, err := os.Open(dir)
	if err != nil {
		return fmt.Errorf("blockdev: thaw: %w", err)
	}
	defer f.Close()
	if err := unix.IoctlSetInt(int(f.Fd()), fiThaw, 0); err != nil && !errors.Is(err, unix.EINVAL) {
		return fmt.Errorf("blockdev: thaw %s: %w", dir, err)
	}
	return nil
}
