package microvm

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"os"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/aenv-dev/aenv/internal/vmm"
)

// migrating are the states of an outgoing migration (a capture's save) in progress.
var migrating = []string{"setup", "active", "pre-switchover", "device", "wait-unplug", "cancelling"}

// settle brings a VM the crash caught in a capture back to running, as if the capture
// had failed: a save in progress is cancelled, a RAM file a pause had moved into the
// capture comes back, and a stopped guest continues. The capture's files are left for
// ReconcileCaptures (nothing registered them). A guest that is still loading a restore
// (inmigrate) cannot be settled.
func (b *Backend) settle(ctx context.Context, m *vmm.Machine, st savedState) error {
	status := func() (string, error) {
		var mig struct {
			Status string `json:"status"`
		}
		err := m.QMP().Execute(ctx, "query-migrate", nil, &mig)
		return mig.Status, err
	}
	s, err := status()
	if err != nil {
		return err
	}
	if slices.Contains(migrating, s) {
		b.log.Info("microvm: reconcile: cancelling a capture's save the crash interrupted", "pid", m.PID(), "status", s)
		if err := m.QMP().Execute(ctx, "migrate_cancel", nil, nil); err != nil {
			return err
		}
		for slices.Contains(migrating, s) {
			select {
			case <-ctx.Done():
				return fmt.Errorf("migration still %s: %w", s, ctx.Err())
			case <-time.After(5 * time.Millisecond):
			}
			if s, err = status(); err != nil {
				return err
			}
		}
	}
	if !st.PrivateRAM {
		if err := b.reclaimRAM(m.PID(), st.RAMFile); err != nil {
			return err
		}
	}
	run, err := m.Status(ctx)
	if err != nil {
		return err
	}
	switch run {
	case "running":
		return nil
	case "paused", "postmigrate", "finish-migrate":
		b.log.Info("microvm: reconcile: continuing a guest a capture had stopped", "pid", m.PID(), "status", run)
		return m.Resume(ctx)
	default:
		return fmt.Errorf("guest is %q", run)
	}
}

// reclaimRAM makes sure the VM's RAM file is at ram: a pause the crash interrupted may
// have moved it into its capture (QEMU's mapping follows the file, so /proc tells where
// it is now).
func (b *Backend) reclaimRAM(pid int, ram string) error {
	if _, err := os.Stat(ram); err == nil {
		return nil
	}
	f, err := os.Open("/proc/" + strconv.Itoa(pid) + "/maps")
	if err != nil {
		return fmt.Errorf("RAM file %s gone and maps unreadable: %w", ram, err)
	}
	defer f.Close()
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		fields := strings.Fields(sc.Text())
		if len(fields) != 6 {
			continue // anonymous, or "(deleted)"
		}
		p := fields[5]
		if !within(p, b.cfg.imagesDir()) || !strings.HasSuffix(p, "/ram") {
			continue
		}
		if err := os.Rename(p, ram); err != nil {
			return fmt.Errorf("take back the RAM file from %s: %w", p, err)
		}
		b.log.Info("microvm: reconcile: took back the RAM file an interrupted pause had moved", "pid", pid, "from", p)
		return os.Chmod(ram, 0o600)
	}
	return errors.Join(fmt.Errorf("RAM file %s is gone", ram), sc.Err())
}

// holdsFile reports whether process pid has path open.
func holdsFile(pid int, path string) bool {
	dir := "/proc/" + strconv.Itoa(pid) + "/fd"
	ents, err := os.ReadDir(dir)
	if err != nil {
		return false
	}
	for _, e := range ents {
		if t, err := os.Readlink(dir + "/" + e.Name()); err == nil && t == path {
			return true
		}
	}
	return false
}
