package rootfs

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"

	"github.com/aenv-dev/aenv/internal/storage/blockdev"
	"golang.org/x/sys/unix"
)

// Sweep removes what a crashed process left of block roots whose files lie under root:
// ext4 mounts of loop devices backed by a file under root are detached (lazily: a
// container may still hold them), then blockdev.Sweep detaches those loop devices and
// unmounts the FUSE servers' mount points. Call it at startup, after the containers that
// used the roots are gone.
func Sweep(ctx context.Context, root string) error {
	root, err := filepath.Abs(root)
	if err != nil {
		return err
	}
	mounts, err := loopMounts(root)
	var errs []error
	if err != nil {
		errs = append(errs, err)
	}
	for i := len(mounts) - 1; i >= 0; i-- {
		if err := unix.Unmount(mounts[i], unix.MNT_DETACH); err != nil && !errors.Is(err, unix.EINVAL) && !errors.Is(err, unix.ENOENT) {
			errs = append(errs, fmt.Errorf("rootfs: sweep unmount %s: %w", mounts[i], err))
		}
	}
	errs = append(errs, resetLoops(root), blockdev.Sweep(ctx, root))
	return errors.Join(errs...)
}

// loopMounts lists mount points (in mountinfo order) whose source is a loop device
// backed by a file under root.
func loopMounts(root string) ([]string, error) {
	f, err := os.Open("/proc/self/mountinfo")
	if err != nil {
		return nil, fmt.Errorf("rootfs: mountinfo: %w", err)
	}
	defer f.Close()
	backing := map[string]bool{} // loop device path -> backed under root
	var out []string
	sc := bufio.NewScanner(f)
	sc.Buffer(make([]byte, 64<<10), 1<<20)
	for sc.Scan() {
		fields := strings.Fields(sc.Text())
		sep := -1
		for i, x := range fields {
			if x == "-" {
				sep = i
				break
			}
		}
		if sep < 5 || len(fields) < sep+3 {
			continue
		}
		src := fields[sep+2]
		if !strings.HasPrefix(src, "/dev/loop") {
			continue
		}
		under, ok := backing[src]
		if !ok {
			under = loopBackedUnder(src, root)
			backing[src] = under
		}
		if under {
			out = append(out, unescapeMountinfo(fields[4]))
		}
	}
	return out, sc.Err()
}

func loopBackedUnder(dev, root string) bool {
	b, err := os.ReadFile(filepath.Join("/sys/block", filepath.Base(dev), "loop", "backing_file"))
	if err != nil {
		return false
	}
	p := strings.TrimSuffix(strings.TrimSuffix(string(b), "\n"), " (deleted)")
	return p == root || strings.HasPrefix(p, root+"/")
}

func unescapeMountinfo(s string) string {
	return strings.NewReplacer(`\040`, " ", `\011`, "\t", `\012`, "\n", `\134`, `\`).Replace(s)
}

// resetLoops undoes limitDirty on the loop devices backed by a file under root.
func resetLoops(root string) error {
	var errs []error
	files, _ := filepath.Glob("/sys/block/loop*/loop/backing_file")
	for _, bf := range files {
		dev := "/dev/" + filepath.Base(filepath.Dir(filepath.Dir(bf)))
		if !loopBackedUnder(dev, root) {
			continue
		}
		var st unix.Stat_t
		if err := unix.Stat(dev, &st); err != nil {
			continue
		}
		errs = append(errs, resetDirty(fmt.Sprintf("/sys/class/bdi/%d:%d", unix.Major(st.Rdev), unix.Minor(st.Rdev))))
	}
	return errors.Join(errs...)
}
