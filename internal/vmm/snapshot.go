package vmm

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"time"
)

// State is a saved migration stream: a VM's device state, with or without its RAM.
type State struct {
	// Path is the stream file.
	Path string `json:"path"`
	// IgnoreShared: the stream was taken with x-ignore-shared from a VM whose RAM is a
	// shared file, so it holds no RAM: a restore needs that RAM file (or a copy, or a
	// private mapping of it). QEMU refuses a stream whose capability differs from the
	// destination's, so the restore sets it the same way.
	IgnoreShared bool  `json:"ignoreShared"`
	Size         int64 `json:"size"`
}

// migrateBandwidth lifts QEMU's default 128 MiB/s migration throttle, which applies even
// to a stopped VM (1.5 s → 0.28 s for 128 MiB of touched RAM).
const migrateBandwidth = 64 << 30

// Status is QEMU's run state ("running", "paused", "postmigrate", "inmigrate", ...).
func (m *Machine) Status(ctx context.Context) (string, error) {
	var st struct {
		Status string `json:"status"`
	}
	if err := m.qmp.Execute(ctx, "query-status", nil, &st); err != nil {
		return "", err
	}
	return st.Status, nil
}

// Pause stops the guest's vCPUs (QMP stop, 2–3 ms). Its RAM and devices stay.
func (m *Machine) Pause(ctx context.Context) error {
	return m.qmp.Execute(ctx, "stop", nil, nil)
}

// Resume continues a paused, restored or just-saved guest (QMP cont).
func (m *Machine) Resume(ctx context.Context) error {
	return m.qmp.Execute(ctx, "cont", nil, nil)
}

// SaveDeviceState stops the guest and writes its device state, without RAM, to path
// (~7 ms, ~60 KiB). The VM's RAM must be a shared file: after the stop that file is the
// memory image, and it belongs to this snapshot only while the guest stays stopped — copy
// it (CopyRAMFile) before a Resume, or end the VM. The guest is left stopped.
func (m *Machine) SaveDeviceState(ctx context.Context, path string) (State, error) {
	if !m.cfg.Memory.Share {
		return State{}, errors.New("vmm: device-state snapshot needs RAM in a shared file (share=on); use SaveFull")
	}
	return m.save(ctx, path, true)
}

// SaveFull stops the guest and writes device state and all touched RAM to path (~1 s per
// GiB of touched memory under TCG). The guest is left stopped.
func (m *Machine) SaveFull(ctx context.Context, path string) (State, error) {
	return m.save(ctx, path, false)
}

func (m *Machine) save(ctx context.Context, path string, ignoreShared bool) (State, error) {
	if !filepath.IsAbs(path) {
		return State{}, fmt.Errorf("vmm: state path %q must be absolute", path)
	}
	if err := m.Pause(ctx); err != nil {
		return State{}, err
	}
	if err := m.setMigration(ctx, ignoreShared); err != nil {
		return State{}, err
	}
	tmp := path + ".partial"
	f, err := os.OpenFile(tmp, os.O_CREATE|os.O_TRUNC|os.O_WRONLY, 0o600)
	if err != nil {
		return State{}, fmt.Errorf("vmm: state file: %w", err)
	}
	size, err := m.migrateToFile(ctx, f)
	if err != nil {
		os.Remove(tmp)
		return State{}, err
	}
	if err := os.Rename(tmp, path); err != nil {
		os.Remove(tmp)
		return State{}, fmt.Errorf("vmm: state file: %w", err)
	}
	return State{Path: path, IgnoreShared: ignoreShared, Size: size}, nil
}

// migrationFD is the name under which the stream's file descriptor is handed to QEMU.
const migrationFD = "aenv-migration"

// migrateToFile streams the migration into f through a passed descriptor (fd: URI):
// no shell and no cat process per snapshot, no path quoting. f is synced and closed.
func (m *Machine) migrateToFile(ctx context.Context, f *os.File) (int64, error) {
	defer f.Close()
	if err := m.qmp.ExecuteWithFile(ctx, "getfd", map[string]any{"fdname": migrationFD}, nil, f); err != nil {
		return 0, err
	}
	if err := m.qmp.Execute(ctx, "migrate", map[string]any{"uri": "fd:" + migrationFD}, nil); err != nil {
		_ = m.qmp.Execute(context.WithoutCancel(ctx), "closefd", map[string]any{"fdname": migrationFD}, nil)
		return 0, err
	}
	if err := m.waitMigration(ctx); err != nil {
		_ = m.qmp.Execute(context.WithoutCancel(ctx), "migrate_cancel", nil, nil)
		return 0, err
	}
	st, err := f.Stat()
	if err == nil {
		err = f.Sync()
	}
	if err != nil {
		return 0, fmt.Errorf("vmm: state file: %w", err)
	}
	return st.Size(), nil
}

func (m *Machine) setMigration(ctx context.Context, ignoreShared bool) error {
	caps := map[string]any{"capabilities": []map[string]any{
		{"capability": "x-ignore-shared", "state": ignoreShared},
	}}
	if err := m.qmp.Execute(ctx, "migrate-set-capabilities", caps, nil); err != nil {
		return err
	}
	return m.qmp.Execute(ctx, "migrate-set-parameters", map[string]any{"max-bandwidth": migrateBandwidth}, nil)
}

// waitMigration polls query-migrate until the migration has completed or failed.
func (m *Machine) waitMigration(ctx context.Context) error {
	delay := 500 * time.Microsecond
	for {
		var st struct {
			Status    string `json:"status"`
			ErrorDesc string `json:"error-desc"`
		}
		if err := m.qmp.Execute(ctx, "query-migrate", nil, &st); err != nil {
			return err
		}
		switch st.Status {
		case "completed":
			return nil
		case "failed", "cancelled":
			return fmt.Errorf("vmm: migration %s: %s", st.Status, st.ErrorDesc)
		}
		select {
		case <-ctx.Done():
			return fmt.Errorf("vmm: migration: %w", ctx.Err())
		case <-m.exited:
			return fmt.Errorf("vmm: QEMU exited during migration: %v", m.waitErr)
		case <-time.After(delay):
		}
		delay = min(2*delay, 4*time.Millisecond)
	}
}

// Restore starts a VM from a saved state and resumes it. cfg must have the same devices,
// in the same order, as the VM the state was taken from, and for a device-state-only
// stream its RAM must be that VM's RAM file: mapped private (a copy-on-write fork, the
// file is never changed) or shared on a copy of the file. On error nothing is left
// running.
func Restore(ctx context.Context, cfg Config, st State) (*Machine, error) {
	m, err := RestorePaused(ctx, cfg, st)
	if err != nil {
		return nil, err
	}
	if err := m.Resume(ctx); err != nil {
		m.Kill()
		return nil, err
	}
	return m, nil
}

// RestorePaused is Restore without the final Resume: the guest is loaded and stopped.
func RestorePaused(ctx context.Context, cfg Config, st State) (*Machine, error) {
	if _, err := os.Stat(st.Path); err != nil {
		return nil, fmt.Errorf("vmm: restore: %w", err)
	}
	if st.IgnoreShared {
		if _, err := os.Stat(cfg.Memory.Path); err != nil {
			return nil, fmt.Errorf("vmm: restore needs the snapshot's RAM file: %w", err)
		}
	}
	cfg.Incoming = true
	m, err := Start(ctx, cfg)
	if err != nil {
		return nil, err
	}
	t0 := time.Now()
	if err := m.incoming(ctx, st); err != nil {
		m.Kill()
		return nil, fmt.Errorf("vmm: restore %s: %w", st.Path, err)
	}
	m.timings.Load = time.Since(t0)
	return m, nil
}

// incoming loads st into a machine started with -incoming defer. It is the restore's
// critical path, so it spends as few monitor round trips as it can: one for the
// capabilities (the bandwidth limit only throttles a sender), one for the descriptor, one
// to start, and then it waits for QEMU's MIGRATION event rather than polling.
func (m *Machine) incoming(ctx context.Context, st State) error {
	caps := map[string]any{"capabilities": []map[string]any{
		{"capability": "x-ignore-shared", "state": st.IgnoreShared},
		{"capability": "events", "state": true},
	}}
	if err := m.qmp.Execute(ctx, "migrate-set-capabilities", caps, nil); err != nil {
		return err
	}
	f, err := os.Open(st.Path)
	if err != nil {
		return fmt.Errorf("vmm: state file: %w", err)
	}
	defer f.Close() // QEMU reads its own copy of the descriptor
	if err := m.qmp.ExecuteWithFile(ctx, "getfd", map[string]any{"fdname": migrationFD}, nil, f); err != nil {
		return err
	}
	if err := m.qmp.Execute(ctx, "migrate-incoming", map[string]any{"uri": "fd:" + migrationFD}, nil); err != nil {
		return err
	}
	// A failed incoming migration makes QEMU 7.2 exit, which waitIncoming reports.
	return m.waitIncoming(ctx)
}

// incomingPoll is how often waitIncoming asks as well, in case an event was dropped (the
// monitor keeps a bounded number for readers that do not drain them).
const incomingPoll = 25 * time.Millisecond

// waitIncoming waits for the MIGRATION event that ends an incoming migration.
func (m *Machine) waitIncoming(ctx context.Context) error {
	poll := time.NewTicker(incomingPoll)
	defer poll.Stop()
	for {
		select {
		case ev := <-m.qmp.Events():
			if ev.Name != "MIGRATION" {
				continue
			}
			var d struct {
				Status string `json:"status"`
			}
			if err := json.Unmarshal(ev.Data, &d); err != nil {
				return fmt.Errorf("vmm: MIGRATION event %s: %w", ev.Data, err)
			}
			switch d.Status {
			case "completed":
				return nil
			case "failed", "cancelled":
				return m.waitMigration(ctx) // its answer carries the error's description
			}
		case <-poll.C:
			var st struct {
				Status string `json:"status"`
			}
			if err := m.qmp.Execute(ctx, "query-migrate", nil, &st); err != nil {
				return err
			}
			if st.Status == "completed" || st.Status == "failed" || st.Status == "cancelled" {
				return m.waitMigration(ctx)
			}
		case <-ctx.Done():
			return fmt.Errorf("vmm: migration: %w", ctx.Err())
		case <-m.exited:
			return fmt.Errorf("vmm: QEMU exited during migration: %v", m.waitErr)
		}
	}
}
