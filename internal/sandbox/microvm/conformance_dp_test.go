package microvm

import (
	"testing"
	"time"

	"github.com/aenv-dev/aenv/internal/dataplane"
	"github.com/aenv-dev/aenv/internal/sandbox"
	"github.com/aenv-dev/aenv/internal/sandbox/sandboxtest"
)

// TestConformanceDataPlane runs the backend suite as a node runs the backend: root disks
// served by a data-plane process (a child in a session of its own), so a crash of the
// backend leaves the disks and their VMs running and the new backend adopts them.
func TestConformanceDataPlane(t *testing.T) {
	sandboxtest.Run(t, func(t *testing.T) *sandboxtest.Env {
		needVM(t)
		fixtures(t)
		// Started first: its cleanup (no disk left served) runs after the backend's.
		sock := startTestDataPlane(t)
		b := newTestBackend(t, func(c *Config) { c.DataPlane = dataplane.NewClient(sock) })
		return &sandboxtest.Env{Backend: b, Root: fix.template, Guest: sandboxtest.EnvdGuest{},
			Resources: sandbox.Resources{CPUCount: 1, MemoryMB: testMemMB},
			Crash:     func(t *testing.T) sandbox.Backend { return crash(t, b) },
			Survives:  true,
			Ready:     2 * time.Minute,
		}
	})
}
