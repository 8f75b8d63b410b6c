// Package mock is an in-memory sandbox.Backend for the orchestrator's unit tests. Each
// instance runs a fake envd on a loopback httptest server, so the orchestrator's real
// health and init HTTP path is exercised, and every stage can be made to fail or block
// through hooks and injected errors.
//
// It is a test double only: nothing is isolated and no process is started.
package mock

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"slices"
	"sync"
	"time"

	"github.com/aenv-dev/aenv/internal/sandbox"
)

// Stage names a point where a failure can be injected or a hook can block.
type Stage string

const (
	StageLaunch     Stage = "launch"      // Backend.Launch
	StageEnvdHealth Stage = "envd_health" // fake envd GET /health (503 on error)
	StageEnvdInit   Stage = "envd_init"   // fake envd POST /init (500 on error)
	StagePause      Stage = "pause"       // Instance.Pause
	StageResume     Stage = "resume"      // Instance.Resume
	StageStop       Stage = "stop"        // Instance.Stop
	StageStats      Stage = "stats"       // Instance.Stats
	StageSnapshot   Stage = "snapshot"    // Instance.Snapshot
	StageDecode     Stage = "decode"      // Backend.DecodePaused
	StageDecodeSnap Stage = "decode_snap" // Backend.DecodeCaptured
	StageReconcile  Stage = "reconcile"   // Backend.Reconcile
	StageDiscard    Stage = "discard"     // Backend.DiscardPaused
	StageEgress     Stage = "egress"      // Instance.UpdateEgress
)

// Hook runs at every stage before injected failures are consulted; a non-nil error
// fails the stage. Hooks may block (to hold an operation mid-flight in race tests).
type Hook func(stage Stage, sandboxID string) error

// Options configure a Backend.
type Options struct {
	Capabilities sandbox.Capabilities
	// StopOnPause makes Pause stop the instance, the way a VM snapshot does, so the
	// orchestrator must resume through Launch(LaunchResume). Otherwise pause freezes the
	// instance in place (cgroup freezer) and Instance.Resume thaws it.
	StopOnPause bool
	// HoldStartCommands keeps processes started through the fake envd running after
	// their first line of output, until Envd.End, so tests can re-attach to them with
	// Connect (as to a server a template starts). Otherwise they exit at once.
	HoldStartCommands bool
	// LayeredOnly makes the mock a backend that cannot boot directory roots (a VM), so
	// it never gets a template's directory (sandbox.DirectoryBooter).
	LayeredOnly bool
}

// PausedState is the mock's opaque paused state. With StopOnPause it carries the
// instance's files (and processes when memory is kept), as a VM's stored state would.
type PausedState struct {
	SandboxID  string            `json:"sandboxID"`
	KeepMemory bool              `json:"keepMemory"`
	Frozen     bool              `json:"frozen"`
	Files      map[string][]byte `json:"files,omitempty"`
	Procs      []string          `json:"procs,omitempty"`
}

// Encode implements sandbox.PausedState.
func (p *PausedState) Encode() ([]byte, error) { return json.Marshal(p) }

type failure struct {
	err   error
	times int // <0: forever
}

// Backend is the mock sandbox.Backend. The zero value is not usable; call New.
type Backend struct {
	opts Options

	mu        sync.Mutex
	hook      Hook
	failures  map[Stage]*failure
	instances map[string]*Instance // running or frozen
	artifacts map[string]bool      // ids with stored paused state (StopOnPause)
	launches  []sandbox.LaunchPlan
	stopped   []string
	removed   []string // stopped by Reconcile as unknown
	discarded []string
	// discardedSnaps are source ids of captures passed to DiscardSnapshot.
	discardedSnaps []string
}

// The optional behaviours of the sandbox contract the mock has (the orchestrator's
// unit tests rely on them being found).
var (
	_ sandbox.Backend           = (*Backend)(nil)
	_ sandbox.PausedDiscarder   = (*Backend)(nil)
	_ sandbox.SnapshotDiscarder = (*Backend)(nil)
	_ sandbox.DirectoryBooter   = (*Backend)(nil)
	_ sandbox.EgressUpdater     = (*Instance)(nil)
)

// New returns an empty mock backend.
func New(o Options) *Backend {
	return &Backend{
		opts:      o,
		failures:  map[Stage]*failure{},
		instances: map[string]*Instance{},
		artifacts: map[string]bool{},
	}
}

// SetHook installs (or with nil removes) the stage hook.
func (b *Backend) SetHook(h Hook) {
	b.mu.Lock()
	b.hook = h
	b.mu.Unlock()
}

// Fail makes the next times calls of stage fail with err (times < 0: until cleared).
func (b *Backend) Fail(stage Stage, err error, times int) {
	b.mu.Lock()
	b.failures[stage] = &failure{err: err, times: times}
	b.mu.Unlock()
}

// ClearFailures removes every injected failure.
func (b *Backend) ClearFailures() {
	b.mu.Lock()
	clear(b.failures)
	b.mu.Unlock()
}

func (b *Backend) check(stage Stage, id string) error {
	b.mu.Lock()
	h := b.hook
	b.mu.Unlock()
	if h != nil {
		if err := h(stage, id); err != nil {
			return err
		}
	}
	b.mu.Lock()
	defer b.mu.Unlock()
	f := b.failures[stage]
	if f == nil || f.times == 0 {
		return nil
	}
	if f.times > 0 {
		f.times--
	}
	return fmt.Errorf("mock %s %s: %w", stage, id, f.err)
}

// Name implements sandbox.Backend.
func (b *Backend) Name() string { return "mock" }

// BootsDirectories implements sandbox.DirectoryBooter: true unless Options.LayeredOnly.
func (b *Backend) BootsDirectories() bool { return !b.opts.LayeredOnly }

// Capabilities implements sandbox.Backend.
func (b *Backend) Capabilities() sandbox.Capabilities { return b.opts.Capabilities }

// Launch implements sandbox.Backend: it starts a fake envd for the instance.
func (b *Backend) Launch(ctx context.Context, plan sandbox.LaunchPlan) (sandbox.Instance, error) {
	if plan.SandboxID == "" {
		return nil, errors.New("mock launch: empty sandbox id")
	}
	if err := b.check(StageLaunch, plan.SandboxID); err != nil {
		return nil, err
	}
	inst := &Instance{b: b, id: plan.SandboxID, plan: plan, files: map[string][]byte{}}
	switch plan.Kind {
	case sandbox.LaunchResume:
		ps, ok := plan.Paused.(*PausedState)
		if !ok || ps.SandboxID != plan.SandboxID {
			return nil, fmt.Errorf("mock launch: resume of %s without its paused state (%T)", plan.SandboxID, plan.Paused)
		}
		inst.files, inst.procs = cloneFiles(ps.Files), slices.Clone(ps.Procs)
	case sandbox.LaunchFromSnapshot:
		c, ok := plan.Snapshot.(*Captured)
		if !ok || c == nil {
			return nil, fmt.Errorf("mock launch: %s from snapshot without a mock capture (%T)", plan.SandboxID, plan.Snapshot)
		}
		if !b.opts.Capabilities.Snapshots {
			return nil, fmt.Errorf("mock launch: %s: snapshots are disabled", plan.SandboxID)
		}
		inst.files = cloneFiles(c.Files)
		if !plan.ColdBoot {
			inst.procs = slices.Clone(c.Procs)
		}
	}
	b.mu.Lock()
	defer b.mu.Unlock()
	if _, dup := b.instances[plan.SandboxID]; dup {
		return nil, fmt.Errorf("mock launch: %s is already running", plan.SandboxID)
	}
	inst.envd = newEnvd(func(s Stage) error { return b.check(s, plan.SandboxID) }, b.opts.HoldStartCommands)
	b.instances[plan.SandboxID] = inst
	delete(b.artifacts, plan.SandboxID)
	b.launches = append(b.launches, plan)
	return inst, nil
}

// DecodePaused implements sandbox.Backend.
func (b *Backend) DecodePaused(raw []byte) (sandbox.PausedState, error) {
	var ps PausedState
	if err := json.Unmarshal(raw, &ps); err != nil || ps.SandboxID == "" {
		return nil, fmt.Errorf("mock: bad paused state %q: %v", raw, err)
	}
	if err := b.check(StageDecode, ps.SandboxID); err != nil {
		return nil, err
	}
	return &ps, nil
}

// Reconcile implements sandbox.Backend: known live instances are returned, the rest
// are stopped and unknown paused artifacts dropped.
func (b *Backend) Reconcile(ctx context.Context, known []string) (map[string]sandbox.Instance, error) {
	if err := b.check(StageReconcile, ""); err != nil {
		return nil, err
	}
	b.mu.Lock()
	var orphans []*Instance
	alive := map[string]sandbox.Instance{}
	for id, inst := range b.instances {
		if slices.Contains(known, id) {
			alive[id] = inst
		} else {
			orphans = append(orphans, inst)
			b.removed = append(b.removed, id)
		}
	}
	for id := range b.artifacts {
		if !slices.Contains(known, id) {
			delete(b.artifacts, id)
			b.removed = append(b.removed, id)
		}
	}
	b.mu.Unlock()
	for _, inst := range orphans {
		inst.terminate()
	}
	return alive, nil
}

// DiscardPaused deletes the stored state of a paused sandbox that is not resumed (the
// orchestrator calls it when a paused sandbox is killed).
func (b *Backend) DiscardPaused(ctx context.Context, id string, _ sandbox.PausedState) error {
	if err := b.check(StageDiscard, id); err != nil {
		return err
	}
	b.mu.Lock()
	delete(b.artifacts, id)
	b.discarded = append(b.discarded, id)
	b.mu.Unlock()
	return nil
}

// Vanish makes an instance disappear as if its processes died under the node.
func (b *Backend) Vanish(id string) {
	b.mu.Lock()
	inst := b.instances[id]
	b.mu.Unlock()
	if inst != nil {
		inst.terminate()
	}
}

// Instance returns the live instance of id, or nil.
func (b *Backend) Instance(id string) *Instance {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.instances[id]
}

// Live returns the ids of running or frozen instances, sorted.
func (b *Backend) Live() []string {
	b.mu.Lock()
	defer b.mu.Unlock()
	ids := make([]string, 0, len(b.instances))
	for id := range b.instances {
		ids = append(ids, id)
	}
	slices.Sort(ids)
	return ids
}

// Artifacts returns ids with stored paused state (StopOnPause mode), sorted.
func (b *Backend) Artifacts() []string {
	b.mu.Lock()
	defer b.mu.Unlock()
	var ids []string
	for id := range b.artifacts {
		ids = append(ids, id)
	}
	slices.Sort(ids)
	return ids
}

// Launches returns every plan Launch accepted, in order.
func (b *Backend) Launches() []sandbox.LaunchPlan {
	b.mu.Lock()
	defer b.mu.Unlock()
	return slices.Clone(b.launches)
}

// Removed returns ids Reconcile cleaned up as unknown.
func (b *Backend) Removed() []string {
	b.mu.Lock()
	defer b.mu.Unlock()
	return slices.Clone(b.removed)
}

// Discarded returns ids whose paused state DiscardPaused deleted.
func (b *Backend) Discarded() []string {
	b.mu.Lock()
	defer b.mu.Unlock()
	return slices.Clone(b.discarded)
}

// Instance is a mock sandbox.
type Instance struct {
	b    *Backend
	id   string
	plan sandbox.LaunchPlan
	envd *Envd

	mu      sync.Mutex
	frozen  bool
	stopped bool
	files   map[string][]byte // the sandbox's "filesystem"
	procs   []string          // processes started in it (lost on a cold boot)
	egress  egressRecord      // egress.go
}

var _ sandbox.Instance = (*Instance)(nil)

// ID implements sandbox.Instance.
func (i *Instance) ID() string { return i.id }

// Plan is the plan the instance was launched with.
func (i *Instance) Plan() sandbox.LaunchPlan { return i.plan }

// Envd is the instance's fake envd.
func (i *Instance) Envd() *Envd { return i.envd }

// Frozen reports whether the instance is paused in place.
func (i *Instance) Frozen() bool {
	i.mu.Lock()
	defer i.mu.Unlock()
	return i.frozen
}

// Endpoint implements sandbox.Instance.
func (i *Instance) Endpoint() sandbox.Endpoint {
	host, port := i.envd.hostPort()
	return sandbox.Endpoint{Host: host, EnvdPort: port}
}

func (i *Instance) gone() error {
	i.mu.Lock()
	defer i.mu.Unlock()
	if i.stopped {
		return fmt.Errorf("mock %s: %w", i.id, sandbox.ErrGone)
	}
	return nil
}

// Pause implements sandbox.Instance. An injected error wrapping sandbox.ErrGone also
// kills the instance, as a terminal capture failure would.
func (i *Instance) Pause(ctx context.Context, o sandbox.PauseOptions) (sandbox.PausedState, error) {
	if err := i.gone(); err != nil {
		return nil, err
	}
	if err := i.b.check(StagePause, i.id); err != nil {
		if errors.Is(err, sandbox.ErrGone) {
			i.terminate()
		}
		return nil, err
	}
	ps := &PausedState{SandboxID: i.id, KeepMemory: o.KeepMemory, Frozen: !i.b.opts.StopOnPause}
	if i.b.opts.StopOnPause {
		i.mu.Lock()
		ps.Files = cloneFiles(i.files)
		if o.KeepMemory {
			ps.Procs = slices.Clone(i.procs)
		}
		i.mu.Unlock()
		i.terminate()
		i.b.mu.Lock()
		i.b.artifacts[i.id] = true
		i.b.mu.Unlock()
		return ps, nil
	}
	i.mu.Lock()
	i.frozen = true
	i.mu.Unlock()
	return ps, nil
}

// Resume implements sandbox.Instance (thaw); a stopped instance answers ErrGone.
func (i *Instance) Resume(ctx context.Context) error {
	if err := i.gone(); err != nil {
		return err
	}
	if err := i.b.check(StageResume, i.id); err != nil {
		return err
	}
	i.mu.Lock()
	i.frozen = false
	i.mu.Unlock()
	return nil
}

// Stop implements sandbox.Instance; it is idempotent.
func (i *Instance) Stop(ctx context.Context) error {
	if i.gone() != nil {
		return nil
	}
	if err := i.b.check(StageStop, i.id); err != nil {
		return err
	}
	i.terminate()
	i.b.mu.Lock()
	i.b.stopped = append(i.b.stopped, i.id)
	i.b.mu.Unlock()
	return nil
}

// Stats implements sandbox.Instance with figures derived from the plan.
func (i *Instance) Stats(ctx context.Context) (sandbox.Stats, error) {
	if err := i.gone(); err != nil {
		return sandbox.Stats{}, err
	}
	if err := i.b.check(StageStats, i.id); err != nil {
		return sandbox.Stats{}, err
	}
	r := i.plan.Resources
	return sandbox.Stats{Timestamp: time.Now().UTC(), CPUCount: r.CPUCount, CPUUsedPct: 1.5,
		MemUsed: 64 << 20, MemTotal: int64(r.MemoryMB) << 20, DiskUsed: 1 << 20, DiskTotal: int64(r.DiskSizeMB) << 20}, nil
}

// terminate stops the instance without hooks or failures.
func (i *Instance) terminate() {
	i.mu.Lock()
	already := i.stopped
	i.stopped = true
	i.mu.Unlock()
	if already {
		return
	}
	i.envd.close()
	i.b.mu.Lock()
	if i.b.instances[i.id] == i {
		delete(i.b.instances, i.id)
	}
	i.b.mu.Unlock()
}
