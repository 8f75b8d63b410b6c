package network

import (
	"errors"
	"fmt"
	"os"
	"strings"

	"github.com/moby/sys/mountinfo"
	"golang.org/x/sys/unix"
)

// netnsDir is where named network namespaces are bind-mounted (iproute2's NETNS_RUN_DIR).
const netnsDir = "/run/netns"

// NetnsDir is where the pool's network namespaces are mounted, a mount point of its own
// unless an older node left it a plain directory holding namespace mounts.
const NetnsDir = netnsDir

// errNetnsDirBusy means netnsDir is a plain directory that already holds namespace
// mounts, so it cannot be made a mount point without hiding them.
var errNetnsDirBusy = errors.New("network: " + netnsDir + " is not a mount point and holds namespace mounts")

// prepareNetnsDir makes dir a shared mount point, exactly as iproute2's `ip netns add`
// does on first use. If dir were left a plain directory, the first `ip netns add` on the
// host would bind-mount it onto itself with every namespace mounted in it: the slots'
// mounts would then be hidden under the new mount, and deleting a slot's namespace would
// unmount only the copy and fail with EBUSY on the file (every stop of a sandbox then
// fails). A mount point that is already there (made by iproute2 or an earlier run) is
// only made shared. When dir is a plain directory holding namespace mounts (left by a
// node that ran before this check existed) it is left alone: errNetnsDirBusy.
func prepareNetnsDir(dir string) error {
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return fmt.Errorf("network: %w", err)
	}
	err := unix.Mount("", dir, "none", unix.MS_SHARED|unix.MS_REC, "")
	if err == nil {
		return nil
	}
	if !errors.Is(err, unix.EINVAL) {
		return fmt.Errorf("network: make %s shared: %w", dir, err)
	}
	// EINVAL: not a mount point yet.
	below, err := mountsBelow(dir)
	if err != nil {
		return err
	}
	if len(below) > 0 {
		return fmt.Errorf("%w: %s", errNetnsDirBusy, strings.Join(below, " "))
	}
	if err := unix.Mount(dir, dir, "none", unix.MS_BIND|unix.MS_REC, ""); err != nil {
		return fmt.Errorf("network: make %s a mount point: %w", dir, err)
	}
	if err := unix.Mount("", dir, "none", unix.MS_SHARED|unix.MS_REC, ""); err != nil {
		return fmt.Errorf("network: make %s shared: %w", dir, err)
	}
	return nil
}

// mountsBelow lists the mount points strictly below dir (this process's view).
func mountsBelow(dir string) ([]string, error) {
	infos, err := mountinfo.GetMounts(mountinfo.PrefixFilter(dir))
	if err != nil {
		return nil, fmt.Errorf("network: mountinfo: %w", err)
	}
	var out []string
	for _, m := range infos {
		if m.Mountpoint != dir {
			out = append(out, m.Mountpoint)
		}
	}
	return out, nil
}
