package microvm

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"

	"github.com/aenv-dev/aenv/internal/sandbox"
	"github.com/aenv-dev/aenv/internal/storage/blockdev"
	"github.com/aenv-dev/aenv/internal/vmm"
)

// Reconcile implements sandbox.Backend. It runs once at startup and removes everything an
// earlier run of this backend left: the FUSE mounts that served their disks (connections
// aborted), QEMU processes (found by the pidfiles in the sandbox directories, killed by
// pid), RAM files, sandbox directories and network slots (with their taps).
//
// No sandbox is adopted, known or not: its disk was served by the previous process, whose
// FUSE connection died with it, so the guest's root filesystem is gone (the OCI backend
// treats its block roots the same way). The known ids are therefore reported dead.
func (b *Backend) Reconcile(ctx context.Context, known []string) (map[string]sandbox.Instance, error) {
	ents, err := os.ReadDir(b.cfg.sandboxesDir())
	if err != nil {
		return nil, fmt.Errorf("microvm: list sandboxes: %w", err)
	}
	b.mu.Lock()
	live := map[string]bool{}
	for id := range b.instances {
		live[id] = true
	}
	b.mu.Unlock()
	var errs []error
	for _, e := range ents {
		if live[e.Name()] || !e.IsDir() {
			continue
		}
		dir := filepath.Join(b.cfg.sandboxesDir(), e.Name())
		// The disk's FUSE connection first: a QEMU blocked on its dead server could not
		// die of SIGKILL until the connection is aborted.
		errs = append(errs, blockdev.Sweep(ctx, dir))
		if err := vmm.KillPIDFile(filepath.Join(dir, pidFileName)); err != nil {
			errs = append(errs, err)
			continue // its files stay for the next start
		}
		b.log.Info("microvm: removed a sandbox left by an earlier run", "dir", dir)
		errs = append(errs, os.RemoveAll(dir))
	}
	errs = append(errs, b.sweepRAM(live))
	// Every slot of this prefix that no live instance holds goes (a VM's tap goes with
	// its QEMU; the slot's namespace with the redirects goes here).
	if _, err := b.pool.Reconcile(ctx, b.liveSlots()); err != nil {
		errs = append(errs, err)
	}
	return map[string]sandbox.Instance{}, errors.Join(errs...)
}

// sweepRAM removes RAM files of sandboxes that are not live.
func (b *Backend) sweepRAM(live map[string]bool) error {
	ents, err := os.ReadDir(b.cfg.RAMDir)
	if err != nil {
		return fmt.Errorf("microvm: list RAM files: %w", err)
	}
	var errs []error
	for _, e := range ents {
		id, ok := strings.CutSuffix(e.Name(), ".ram")
		if !ok || live[id] {
			continue
		}
		if err := os.Remove(filepath.Join(b.cfg.RAMDir, e.Name())); err != nil && !errors.Is(err, os.ErrNotExist) {
			errs = append(errs, err)
		}
	}
	return errors.Join(errs...)
}

func (b *Backend) liveSlots() map[int]bool {
	b.mu.Lock()
	defer b.mu.Unlock()
	keep := map[int]bool{}
	for _, i := range b.instances {
		i.mu.Lock()
		if i.slot != nil {
			keep[i.slot.Index] = i.slot.AllowInternet
		}
		i.mu.Unlock()
	}
	return keep
}
