package rootfs

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"
)

// rcuExpedited switches the kernel's RCU to expedited grace periods (host-wide).
const rcuExpedited = "/sys/kernel/rcu_expedited"

// expeditedMarker, in a root's Dir, says this process switched rcuExpedited on and has
// not switched it back yet: Sweep switches it off after a crash in between.
const expeditedMarker = "rcu-expedited"

// expediteRCU switches RCU grace periods to expedited ones until the returned func
// runs, when they are normal now. FIFREEZE takes the filesystem's three write-level
// percpu semaphores, and each waits for a full RCU grace period unless a freeze ran
// within the last one: about 10 ms each on this kernel (HZ=250, 2 vCPUs), 25-35 ms in
// all, two of them with writes already blocked. Expedited, the freeze takes well under a
// millisecond. The switch is global, so it is on only for the one call; expedited grace
// periods cost other CPUs an IPI each, which for one freeze is nothing.
//
// When it is on already (the operator's choice, or a concurrent freeze elsewhere) it is
// left alone; when sysfs is read-only (an unprivileged or containerised node) the freeze
// just takes the normal time. Neither is an error. dir is the root's Dir (the marker).
func expediteRCU(dir string) (restore func()) {
	noop := func() {}
	v, err := os.ReadFile(rcuExpedited)
	if err != nil || strings.TrimSpace(string(v)) != "0" {
		return noop
	}
	marker := filepath.Join(dir, expeditedMarker)
	if err := os.WriteFile(marker, nil, 0o600); err != nil {
		return noop
	}
	if err := os.WriteFile(rcuExpedited, []byte("1"), 0o644); err != nil {
		os.Remove(marker)
		return noop
	}
	return func() {
		// Only a failed write leaves the marker, for Sweep to retry.
		if err := os.WriteFile(rcuExpedited, []byte("0"), 0o644); err == nil {
			os.Remove(marker)
		}
	}
}

// sweepExpedited switches expedited RCU off again if a root under root (root/*/marker)
// left it on, as a process that died during a freeze does.
func sweepExpedited(root string) error {
	markers, _ := filepath.Glob(filepath.Join(root, "*", expeditedMarker))
	if len(markers) == 0 {
		return nil
	}
	if err := os.WriteFile(rcuExpedited, []byte("0"), 0o644); err != nil {
		return fmt.Errorf("rootfs: switch expedited RCU off: %w", err)
	}
	var errs []error
	for _, m := range markers {
		if err := os.Remove(m); err != nil && !errors.Is(err, os.ErrNotExist) {
			errs = append(errs, err)
		}
	}
	return errors.Join(errs...)
}
