package microvm

import (
	"context"
	"fmt"
	"os"
	"slices"
	"strconv"
	"time"

	"github.com/aenv-dev/aenv/internal/vmm"
)

// migrating are the states of an outgoing migration (a capture's save) in progress.
var migrating = []string{"setup", "active", "pre-switchover", "device", "wait-unplug", "cancelling"}

// settle brings a VM the crash caught in a capture back to running, as if the capture
// had failed: a save in progress is cancelled and a stopped guest continues. The capture's files are left for
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
