package mock

import (
	"context"
	"fmt"
	"os"
	"slices"
	"testing"

	"github.com/aenv-dev/aenv/internal/sandbox"
	"github.com/aenv-dev/aenv/internal/sandbox/sandboxtest"
)

// mockGuest acts on the mock's modelled filesystem and processes.
type mockGuest struct{}

func (mockGuest) inst(i sandbox.Instance) (*Instance, error) {
	m, ok := i.(*Instance)
	if !ok {
		return nil, fmt.Errorf("not a mock instance: %T", i)
	}
	if err := m.gone(); err != nil {
		return nil, err
	}
	return m, nil
}

func (g mockGuest) WriteFile(_ context.Context, i sandbox.Instance, path, data string) error {
	m, err := g.inst(i)
	if err == nil {
		m.WriteFile(path, []byte(data))
	}
	return err
}

func (g mockGuest) ReadFile(_ context.Context, i sandbox.Instance, path string) (string, error) {
	m, err := g.inst(i)
	if err != nil {
		return "", err
	}
	b, ok := m.ReadFile(path)
	if !ok {
		return "", fmt.Errorf("%s: %w", path, os.ErrNotExist)
	}
	return string(b), nil
}

func (g mockGuest) StartProcess(_ context.Context, i sandbox.Instance, name string) error {
	m, err := g.inst(i)
	if err == nil {
		m.StartProcess(name)
	}
	return err
}

func (g mockGuest) Running(_ context.Context, i sandbox.Instance, name string) (bool, error) {
	m, err := g.inst(i)
	if err != nil {
		return false, err
	}
	return slices.Contains(m.Processes(), name), nil
}

// Limits are the mock's Stats, which model the plan's resources.
func (g mockGuest) Limits(ctx context.Context, i sandbox.Instance) (sandbox.Resources, error) {
	st, err := i.Stats(ctx)
	return sandbox.Resources{CPUCount: st.CPUCount, MemoryMB: int(st.MemTotal >> 20)}, err
}

// TestConformance runs the backend suite on the mock as a container-like backend
// (files-only snapshots, pause in place) and a VM-like one (memory snapshots, live fork,
// pause stops the instance), and without snapshots.
func TestConformance(t *testing.T) {
	for _, tc := range []struct {
		name string
		opts Options
	}{
		{"container", Options{Capabilities: sandbox.Capabilities{PauseKeepsProcesses: true, Snapshots: true}}},
		{"vm", Options{StopOnPause: true, Capabilities: sandbox.Capabilities{MemorySnapshots: true,
			PauseKeepsProcesses: true, PauseReleasesMemory: true, LiveFork: true, Snapshots: true}}},
		{"no-snapshots", Options{Capabilities: sandbox.Capabilities{PauseKeepsProcesses: true}}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			sandboxtest.Run(t, func(t *testing.T) *sandboxtest.Env {
				b := New(tc.opts)
				t.Cleanup(func() {
					if live := b.Live(); len(live) > 0 {
						t.Errorf("instances left running: %v", live)
					}
				})
				return &sandboxtest.Env{Backend: b, Guest: mockGuest{}, Root: sandbox.RootFS{LowerDir: "/srv/base"},
					Resources: sandbox.Resources{CPUCount: 1, MemoryMB: 128},
					// The mock is the host: a restarted node finds the same instances.
					Crash: func(*testing.T) sandbox.Backend { return b }}
			})
		})
	}
}
