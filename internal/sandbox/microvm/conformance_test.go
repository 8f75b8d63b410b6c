package microvm

import (
	"context"
	"testing"
	"time"

	"github.com/aenv-dev/aenv/internal/sandbox"
	"github.com/aenv-dev/aenv/internal/sandbox/sandboxtest"
)

// TestConformance runs the backend suite on QEMU microVMs (TCG here) with the real envd as
// the guest's PID 1 and layered root disks, as root.
func TestConformance(t *testing.T) {
	sandboxtest.Run(t, func(t *testing.T) *sandboxtest.Env {
		b := newTestBackend(t)
		return &sandboxtest.Env{Backend: b, Root: fix.template, Guest: sandboxtest.EnvdGuest{},
			Resources: sandbox.Resources{CPUCount: 1, MemoryMB: testMemMB},
			Crash:     func(t *testing.T) sandbox.Backend { return crash(t, b) },
			// TCG boots on a shared 2-vCPU machine.
			Ready: 2 * time.Minute,
		}
	})
}

// crash drops b as a SIGKILL of the node would: its instances are forgotten unstopped
// (their QEMUs run on), their monitor connections closed (QEMU takes one client at a
// time: a dead node's is closed by the kernel), and their disks' FUSE servers are as good
// as dead once the new backend's Reconcile aborts their connections — unless a data plane
// serves them, which outlives the node. The new backend over the same data directory is
// cleaned up and checked at the end of t.
func crash(t *testing.T, b *Backend) sandbox.Backend {
	t.Helper()
	b.mu.Lock()
	for _, i := range b.instances {
		i.mu.Lock()
		if i.proc != nil && i.proc.m.QMP() != nil {
			i.proc.m.QMP().Close()
		}
		i.mu.Unlock()
	}
	b.instances = map[string]*Instance{}
	b.mu.Unlock()
	b2, err := New(context.Background(), b.cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		b2.mu.Lock()
		var left []*Instance
		for _, i := range b2.instances {
			left = append(left, i)
		}
		b2.mu.Unlock()
		for _, i := range left {
			if err := i.Stop(context.Background()); err != nil {
				t.Errorf("stop %s: %v", i.id, err)
			}
		}
		if err := b2.pool.Teardown(context.Background()); err != nil {
			t.Errorf("network teardown: %v", err)
		}
		assertClean(t, b2)
	})
	return b2
}
