package microvm

import (
	"fmt"
	"os"
	"strconv"
	"strings"

	"github.com/aenv-dev/aenv/internal/vmm"
)

// DefaultQEMUUser is the user confined QEMUs run as: an id no account of a Debian system
// has (the range 64000-64999 is Debian's, unallocated above 64045), so QEMU owns no host
// file and cannot signal any other process of the host but other QEMUs.
const DefaultQEMUUser = "64400:64400"

// parseUser reads "uid:gid" (positive numbers).
func parseUser(s string) (uid, gid int, err error) {
	u, g, ok := strings.Cut(s, ":")
	uid, uerr := strconv.Atoi(u)
	gid, gerr := strconv.Atoi(g)
	if !ok || uerr != nil || gerr != nil || uid <= 0 || gid <= 0 {
		return 0, 0, fmt.Errorf("microvm: QEMUUser %q: want uid:gid, both positive", s)
	}
	return uid, gid, nil
}

// confinement prepares how every QEMU of the backend is confined (see vmm.Confinement
// and docs/operations.md): its seccomp filter, its user, and an empty root directory.
// Nil when Config.Unconfined.
func (c *Config) confinement() (*vmm.Confinement, error) {
	if c.Unconfined {
		return nil, nil
	}
	uid, gid, err := parseUser(c.QEMUUser)
	if err != nil {
		return nil, err
	}
	root := c.chrootDir()
	if err := os.MkdirAll(root, 0o555); err != nil {
		return nil, fmt.Errorf("microvm: QEMU's root: %w", err)
	}
	// Empty and not writable by QEMU's user: nothing to see, nothing to plant.
	if ents, err := os.ReadDir(root); err != nil || len(ents) > 0 {
		return nil, fmt.Errorf("microvm: QEMU's root %s must be an empty directory (%v)", root, err)
	}
	if err := os.Chmod(root, 0o555); err != nil {
		return nil, fmt.Errorf("microvm: QEMU's root: %w", err)
	}
	return &vmm.Confinement{UID: uid, GID: gid, Chroot: root, Seccomp: true}, nil
}
