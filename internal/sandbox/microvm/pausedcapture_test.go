package microvm

import (
	"testing"

	"github.com/aenv-dev/aenv/internal/sandbox"
)

type otherPaused struct{}

func (otherPaused) Encode() ([]byte, error) { return []byte("{}"), nil }

// A paused VM is published for other nodes only as what it is: a capture with its
// memory image. (That another node restores such a capture with its processes is
// TestMemoryImageOnAnotherNode; through a cluster, test/e2e/microvm-cluster.test.mjs.)
func TestPausedCapture(t *testing.T) {
	b := &Backend{}
	withMemory := &capture{Backend: "microvm", ID: "p", Layers: []sandbox.LayerRef{{Path: "/x"}},
		Memory: &memImage{State: memBlob{Path: "/x/state", Role: roleVMState}}}
	noMemory := &capture{Backend: "microvm", ID: "p", Layers: []sandbox.LayerRef{{Path: "/x"}}}
	for _, tc := range []struct {
		name string
		ps   sandbox.PausedState
		want bool
	}{
		{"memory image", withMemory, true},
		{"disk only", noMemory, false},
		{"another backend's state", otherPaused{}, false},
	} {
		c, ok := b.PausedCapture(tc.ps)
		if ok != tc.want || (ok && c != sandbox.Captured(withMemory)) {
			t.Errorf("%s: PausedCapture = %v, %t; want %t", tc.name, c, ok, tc.want)
		}
	}
}
