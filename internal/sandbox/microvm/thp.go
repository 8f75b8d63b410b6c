package microvm

import (
	"fmt"

	"golang.org/x/sys/unix"
)

// noHugePages turns transparent huge pages off for this process and every process it
// starts from now on (PR_SET_THP_DISABLE is inherited across fork and execve), QEMU
// included. Under TCG, QEMU asks for huge pages on its translation cache (MADV_HUGEPAGE),
// and the kernel then backs every 2 MiB of it that holds any code with a whole huge page:
// an idle fork held 14–16 MiB of cache where 12.5 MiB was in use, and another 2 MiB huge
// page for a small allocation. Without them an idle 512 MiB fork's PSS went from 43–44 to
// 38.7 MiB. TCG gains nothing from huge pages (its guest TLB maps 4 KiB pages). Under KVM
// they are kept: there they back guest RAM, which the hardware maps.
//
// The setting is the process's: the node's own memory and its other children (the data
// plane) get no huge pages either, which a node does not need.
func noHugePages() error {
	if err := unix.Prctl(unix.PR_SET_THP_DISABLE, 1, 0, 0, 0); err != nil {
		return fmt.Errorf("microvm: disable transparent huge pages: %w", err)
	}
	return nil
}
