package oci

import (
	"context"
	"testing"

	"github.com/aenv-dev/aenv/internal/sandbox"
	"github.com/aenv-dev/aenv/internal/sandbox/sandboxtest"
)

// TestConformance runs the backend suite with real runc and real crun, the real envd
// and layered roots (FUSE, loop devices, ext4), as root.
func TestConformance(t *testing.T) {
	eachRuntime(t, func(t *testing.T, runtime string) {
		sandboxtest.Run(t, func(t *testing.T) *sandboxtest.Env {
			needBlock(t)
			envd := testEnvd(t)
			if envd == "" {
				t.Skip("needs the envd binary (go build ./cmd/envd failed)")
			}
			e := newTestBackend(t, func(c *Config) { c.EnvdPath, c.InitArgs, c.Runtime = envd, nil, runtime })
			return &sandboxtest.Env{Backend: e.b, Root: testLayered(t), Guest: sandboxtest.EnvdGuest{},
				Resources: sandbox.Resources{CPUCount: 1, MemoryMB: 256},
				Crash:     func(t *testing.T) sandbox.Backend { return crash(t, e) }}
		})
	})
}

// crash drops e's backend as a SIGKILL of the node would: its instances are forgotten
// unstopped and the FUSE servers of their block roots (node goroutines) die. The new
// backend over the same data directory is cleaned up and checked at the end of t.
func crash(t *testing.T, e *testEnv) sandbox.Backend {
	t.Helper()
	e.b.mu.Lock()
	insts := e.b.instances
	e.b.instances = map[string]*Instance{}
	e.b.mu.Unlock()
	for _, i := range insts {
		i.mu.Lock()
		if i.root != nil {
			_ = i.root.Close()
		}
		i.mu.Unlock()
	}
	b2, err := New(context.Background(), e.cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { cleanupBackend(t, b2) })
	return b2
}
