package rootfs

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"

	"github.com/aenv-dev/aenv/internal/dataplane"

	"golang.org/x/sys/unix"
)

// DefaultMaxDirty bounds the dirty page cache of one root's device. A snapshot's freeze
// has to flush what a writer racing it dirtied meanwhile, up to this much, while a larger
// budget lets buffered writes run further ahead. Measured (BenchmarkSnapshotStall and
// BenchmarkSnapshotAfterWrites, 2 vCPUs): at 8 / 16 / 32 MiB the window with a writer in a
// loop was ~7 / ~10 / ~17 ms (p90 ~8-23 / 10-13 / 25-34) and a 1 GiB burst was written
// at ~590 / ~700 / ~800 MiB/s.
const DefaultMaxDirty = dataplane.DefaultMaxDirty

// limitDirty caps the dirty page cache of block device dev at max bytes, strictly (also
// below the global background threshold), so written data keeps flowing down to the
// stack's upper. A snapshot then only has to flush at most max bytes, whatever the root
// wrote before: its time does not grow with the data written. The returned func puts the
// kernel's defaults back (loop devices are reused; ResetDirty does the same for a device
// a crash left limited).
func limitDirty(dev string, max uint64) (restore func() error, err error) {
	var st unix.Stat_t
	if err := unix.Stat(dev, &st); err != nil {
		return nil, fmt.Errorf("rootfs: stat %s: %w", dev, err)
	}
	dir := filepath.Join("/sys/class/bdi", fmt.Sprintf("%d:%d", unix.Major(st.Rdev), unix.Minor(st.Rdev)))
	read := func(name string) (string, error) {
		b, err := os.ReadFile(filepath.Join(dir, name))
		return strings.TrimSpace(string(b)), err
	}
	write := func(name, v string) error {
		return os.WriteFile(filepath.Join(dir, name), []byte(v), 0o644)
	}
	if _, err := read("strict_limit"); err != nil {
		return nil, fmt.Errorf("rootfs: dirty limit of %s: %w", dev, err)
	}
	restore = func() error { return resetDirty(dir) }
	if err := write("max_bytes", strconv.FormatUint(max, 10)); err != nil {
		return nil, fmt.Errorf("rootfs: dirty limit of %s: %w", dev, err)
	}
	if err := write("strict_limit", "1"); err != nil {
		return nil, errors.Join(fmt.Errorf("rootfs: dirty limit of %s: %w", dev, err), restore())
	}
	return restore, nil
}

// resetDirty puts a device's writeback limits back to the kernel's defaults.
func resetDirty(bdi string) error {
	return errors.Join(
		os.WriteFile(filepath.Join(bdi, "strict_limit"), []byte("0"), 0o644),
		os.WriteFile(filepath.Join(bdi, "max_ratio"), []byte("100"), 0o644))
}

// bdiDir is the writeback settings directory of block device dev.
func bdiDir(dev string) (string, error) {
	var st unix.Stat_t
	if err := unix.Stat(dev, &st); err != nil {
		return "", fmt.Errorf("rootfs: stat %s: %w", dev, err)
	}
	return filepath.Join("/sys/class/bdi", fmt.Sprintf("%d:%d", unix.Major(st.Rdev), unix.Minor(st.Rdev))), nil
}
