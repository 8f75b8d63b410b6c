package mock

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"slices"

	"github.com/aenv-dev/aenv/internal/sandbox"
)

// Captured is the mock's snapshot: a deep copy of the instance's files, and of its
// processes when the backend claims memory snapshots. Tests use it to check that
// children never see each other's or the parent's later writes.
type Captured struct {
	SourceID string            `json:"sourceID"`
	Files    map[string][]byte `json:"files"`
	Procs    []string          `json:"procs,omitempty"`
}

// Encode implements sandbox.Captured.
func (c *Captured) Encode() ([]byte, error) { return json.Marshal(c) }

var _ sandbox.Captured = (*Captured)(nil)

func cloneFiles(m map[string][]byte) map[string][]byte {
	out := make(map[string][]byte, len(m))
	for k, v := range m {
		out[k] = slices.Clone(v)
	}
	return out
}

// DecodeCaptured implements sandbox.Backend.
func (b *Backend) DecodeCaptured(raw []byte) (sandbox.Captured, error) {
	var c Captured
	if err := json.Unmarshal(raw, &c); err != nil || c.SourceID == "" {
		return nil, fmt.Errorf("mock: bad captured state %q: %v", raw, err)
	}
	if err := b.check(StageDecodeSnap, c.SourceID); err != nil {
		return nil, err
	}
	if c.Files == nil {
		c.Files = map[string][]byte{}
	}
	return &c, nil
}

// DiscardSnapshot records that the orchestrator no longer references a capture. The
// mock's captures are self-contained copies, so nothing else is freed.
func (b *Backend) DiscardSnapshot(ctx context.Context, c sandbox.Captured) error {
	mc, ok := c.(*Captured)
	if !ok {
		return fmt.Errorf("mock: discard of a foreign capture %T", c)
	}
	b.mu.Lock()
	b.discardedSnaps = append(b.discardedSnaps, mc.SourceID)
	b.mu.Unlock()
	return nil
}

// DiscardedSnapshots returns the source ids of captures passed to DiscardSnapshot.
func (b *Backend) DiscardedSnapshots() []string {
	b.mu.Lock()
	defer b.mu.Unlock()
	return slices.Clone(b.discardedSnaps)
}

// WriteFile writes a file into the instance's filesystem.
func (i *Instance) WriteFile(path string, data []byte) {
	i.mu.Lock()
	i.files[path] = slices.Clone(data)
	i.mu.Unlock()
}

// ReadFile reads a file of the instance's filesystem.
func (i *Instance) ReadFile(path string) ([]byte, bool) {
	i.mu.Lock()
	defer i.mu.Unlock()
	v, ok := i.files[path]
	return slices.Clone(v), ok
}

// Files returns a copy of the instance's filesystem.
func (i *Instance) Files() map[string][]byte {
	i.mu.Lock()
	defer i.mu.Unlock()
	return cloneFiles(i.files)
}

// StartProcess records a process running in the instance.
func (i *Instance) StartProcess(name string) {
	i.mu.Lock()
	i.procs = append(i.procs, name)
	i.mu.Unlock()
}

// Processes returns the processes running in the instance.
func (i *Instance) Processes() []string {
	i.mu.Lock()
	defer i.mu.Unlock()
	return slices.Clone(i.procs)
}

// Snapshot implements sandbox.Instance: the instance keeps running (or frozen). It
// works only when the backend's Capabilities claim Snapshots. An injected error
// wrapping sandbox.ErrGone kills the instance, as a terminal capture failure would.
func (i *Instance) Snapshot(ctx context.Context) (sandbox.Captured, error) {
	if err := i.gone(); err != nil {
		return nil, err
	}
	if !i.b.opts.Capabilities.Snapshots {
		return nil, fmt.Errorf("mock %s: snapshots are disabled", i.id)
	}
	if err := i.b.check(StageSnapshot, i.id); err != nil {
		if errors.Is(err, sandbox.ErrGone) {
			i.terminate()
		}
		return nil, err
	}
	i.mu.Lock()
	defer i.mu.Unlock()
	c := &Captured{SourceID: i.id, Files: cloneFiles(i.files)}
	if i.b.opts.Capabilities.MemorySnapshots {
		c.Procs = slices.Clone(i.procs)
	}
	return c, nil
}

// Fork implements sandbox.Instance: one capture, then a launch per spec. (The
// orchestrator forks through Snapshot and Launch; this is for direct backend use.)
func (i *Instance) Fork(ctx context.Context, specs []sandbox.ForkSpec) ([]sandbox.ForkResult, error) {
	c, err := i.Snapshot(ctx)
	if err != nil {
		return nil, err
	}
	out := make([]sandbox.ForkResult, len(specs))
	for n, s := range specs {
		inst, err := i.b.Launch(ctx, sandbox.LaunchPlan{Kind: sandbox.LaunchFromSnapshot, SandboxID: s.SandboxID,
			RootFS: i.plan.RootFS, Resources: s.Resources, AllowInternet: i.plan.AllowInternet, Snapshot: c})
		out[n] = sandbox.ForkResult{Instance: inst, Err: err}
	}
	return out, nil
}
