package orchestrator

import (
	"context"
	"encoding/json"
	"fmt"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/aenv-dev/aenv/internal/catalog"
	"github.com/aenv-dev/aenv/internal/repository"
	"github.com/aenv-dev/aenv/internal/sandbox"
	"github.com/aenv-dev/aenv/internal/sandbox/mock"
	"github.com/aenv-dev/aenv/internal/snapshot"
)

// fakeHandoffs records what the orchestrator hands the cluster's repository (the records
// and the claim themselves are tested in internal/snapshot).
type fakeHandoffs struct {
	mu        sync.Mutex
	published []catalog.Template
	records   []json.RawMessage // the sandbox records published with them
	claimed   []string
	deleted   []string
}

func (f *fakeHandoffs) PublishHandoff(_ context.Context, t catalog.Template, _ string, sb json.RawMessage) (*snapshot.Handle, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.published = append(f.published, t)
	f.records = append(f.records, sb)
	return nil, nil
}

// ClaimHandoff hands out the newest handoff published of sandboxID.
func (f *fakeHandoffs) ClaimHandoff(_ context.Context, sandboxID, _ string) (catalog.Template, json.RawMessage, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	for i := len(f.published) - 1; i >= 0; i-- {
		if f.published[i].SourceSandboxID == sandboxID {
			f.claimed = append(f.claimed, f.published[i].ID)
			return f.published[i], f.records[i], nil
		}
	}
	return catalog.Template{}, nil, snapshot.ErrNotFound
}

func (f *fakeHandoffs) ClaimOwnHandoff(_ context.Context, id, _ string) error {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.claimed = append(f.claimed, id)
	return nil
}

func (f *fakeHandoffs) ReleaseHandoff(context.Context, string, string) error { return nil }

func (f *fakeHandoffs) HandoffClaimedElsewhere(context.Context, string, string) (bool, error) {
	return false, nil
}

func (f *fakeHandoffs) Delete(_ context.Context, id string) (repository.GCResult, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.deleted = append(f.deleted, id)
	return repository.GCResult{}, nil
}

// capturerBackend is the mock whose paused state, when it keeps memory, is a capture
// another node could restore (as the microvm backend's is).
type capturerBackend struct{ *mock.Backend }

var _ sandbox.PausedCapturer = capturerBackend{}

func (capturerBackend) PausedCapture(ps sandbox.PausedState) (sandbox.Captured, bool) {
	p, ok := ps.(*mock.PausedState)
	if !ok || !p.KeepMemory {
		return nil, false
	}
	return &mock.Captured{SourceID: p.SandboxID, Files: p.Files, Procs: p.Procs}, true
}

// In a cluster, a pause that keeps memory is published for other nodes when the
// backend's paused state is a capture (sandbox.PausedCapturer), with that state as the
// handoff's artifact; a resume on this node claims it first and deletes it after. Other
// pauses in place stay on the node.
func TestHandoffOfPauseInPlace(t *testing.T) {
	cases := []struct {
		name      string
		capturer  bool
		keep      bool
		published bool
	}{
		{"memory image of a PausedCapturer", true, true, true},
		{"PausedCapturer without the memory", true, false, false},
		{"backend without PausedCapturer", false, true, false},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			ctx := context.Background()
			h := newHarness(t, mock.Options{StopOnPause: true, Capabilities: sandbox.Capabilities{
				MemorySnapshots: true, PauseKeepsProcesses: true, PauseReleasesMemory: true}}, nil)
			if tc.capturer {
				h.wrap = func(b *mock.Backend) sandbox.Backend { return capturerBackend{b} }
				h.restart()
			}
			f := &fakeHandoffs{}
			h.o.EnableHandoff(f, "node-a")
			sb := h.create(CreateRequest{Timeout: time.Hour})
			if err := h.o.Pause(ctx, sb.ID, sandbox.PauseOptions{KeepMemory: tc.keep}); err != nil {
				t.Fatal(err)
			}
			rec := h.stored(sb.ID)
			if !tc.published {
				if len(f.published) != 0 || rec.Handoff != "" {
					t.Fatalf("published %+v, record's handoff %q; want none", f.published, rec.Handoff)
				}
				return
			}
			if len(f.published) != 1 {
				t.Fatalf("published %d handoffs, want 1", len(f.published))
			}
			p := f.published[0]
			if !snapshot.IsHandoff(p.ID) || p.ID != rec.Handoff || p.SourceSandboxID != sb.ID {
				t.Fatalf("handoff %q of %q, record's %q; want one record of %s", p.ID, p.SourceSandboxID, rec.Handoff, sb.ID)
			}
			var c mock.Captured
			if err := json.Unmarshal(p.Artifact, &c); err != nil || c.SourceID != sb.ID || len(rec.DiskSnapshot) != 0 {
				t.Fatalf("handoff artifact %s (%v), want the capture of the paused state %s", p.Artifact, err, rec.Paused)
			}
			if _, _, err := h.o.Connect(ctx, sb.ID, ConnectOptions{Timeout: time.Hour}); err != nil {
				t.Fatal(err)
			}
			if !slices.Equal(f.claimed, []string{p.ID}) || !slices.Equal(f.deleted, []string{p.ID}) {
				t.Fatalf("claimed %v, deleted %v; want the handoff claimed, then deleted", f.claimed, f.deleted)
			}
			if got := h.stored(sb.ID); got.State != StateRunning || got.Handoff != "" {
				t.Fatalf("after the resume: %s, handoff %q", got.State, got.Handoff)
			}
		})
	}
}

// handoffNodes makes two nodes of one cluster (their backends capture memory on a pause
// and keep it, as microVMs do) sharing the handoff store f.
func handoffNodes(t *testing.T) (f *fakeHandoffs, a, b *harness) {
	opts := mock.Options{StopOnPause: true, Capabilities: sandbox.Capabilities{
		MemorySnapshots: true, PauseKeepsProcesses: true, PauseReleasesMemory: true, Snapshots: true}}
	f = &fakeHandoffs{}
	var nodes [2]*harness
	for i := range nodes {
		nodes[i] = newHarness(t, opts, nil)
		nodes[i].wrap = func(b *mock.Backend) sandbox.Backend { return capturerBackend{b} }
		nodes[i].restart()
		nodes[i].o.EnableHandoff(f, fmt.Sprintf("node-%d", i))
	}
	return f, nodes[0], nodes[1]
}

// Another node adopts a published pause with its processes and memory when the pause
// kept them, and with fresh processes after a pause to disk (memory:false), as the node
// that paused it would have resumed it.
func TestAdoptKeepsWhatThePauseKept(t *testing.T) {
	for _, keep := range []bool{true, false} {
		t.Run(fmt.Sprintf("memory=%t", keep), func(t *testing.T) {
			ctx := context.Background()
			f, a, b := handoffNodes(t)
			sb := a.create(CreateRequest{Timeout: time.Hour})
			if err := a.o.Pause(ctx, sb.ID, sandbox.PauseOptions{KeepMemory: keep}); err != nil {
				t.Fatal(err)
			}
			if len(f.published) != 1 {
				t.Fatalf("published %d handoffs, want 1", len(f.published))
			}
			got, resumed, err := b.o.Connect(ctx, sb.ID, ConnectOptions{Timeout: time.Hour, Adopt: true})
			if err != nil || !resumed || got.ID != sb.ID || got.EnvdAccessToken != sb.EnvdAccessToken {
				t.Fatalf("adopt: %+v resumed=%t, %v; want %s with its token", got, resumed, err, sb.ID)
			}
			launches := b.b.Launches()
			plan := launches[len(launches)-1]
			if plan.Kind != sandbox.LaunchFromSnapshot || plan.ColdBoot == keep {
				t.Fatalf("adopting node launched kind %v with ColdBoot %t; want a snapshot launch, ColdBoot %t", plan.Kind, plan.ColdBoot, !keep)
			}
		})
	}
}

// TestConnectWaitsForHandoffForget: a connect (cluster, Adopt) that reaches a node while
// it forgets a record that moved elsewhere (reconcileHandoff's kill) waits for the forget
// and adopts the sandbox, instead of failing with a conflict.
func TestConnectWaitsForHandoffForget(t *testing.T) {
	ctx := context.Background()
	_, a, b := handoffNodes(t)
	sb := a.create(CreateRequest{Timeout: time.Hour})
	if err := a.o.Pause(ctx, sb.ID, sandbox.PauseOptions{KeepMemory: true}); err != nil {
		t.Fatal(err)
	}
	if _, _, err := b.o.Connect(ctx, sb.ID, ConnectOptions{Timeout: time.Hour, Adopt: true}); err != nil {
		t.Fatal(err)
	}
	if err := b.o.Pause(ctx, sb.ID, sandbox.PauseOptions{KeepMemory: true}); err != nil {
		t.Fatal(err)
	}
	// a starts forgetting its stale record, as reconcileHandoff does.
	e, _, err := a.o.acquire(ctx, sb.ID, waitOpts{})
	if err != nil {
		t.Fatal(err)
	}
	p, _ := a.o.begin(e, StateKilling)
	done := make(chan error, 1)
	go func() {
		_, _, err := a.o.Connect(ctx, sb.ID, ConnectOptions{Timeout: time.Hour, Adopt: true})
		done <- err
	}()
	select {
	case err := <-done:
		t.Fatalf("connect during the forget returned %v; want it to wait", err)
	case <-time.After(100 * time.Millisecond):
	}
	a.o.forget(ctx, e, p, nil)
	if err := <-done; err != nil {
		t.Fatalf("connect after the forget: %v", err)
	}
	if got, err := a.o.Get(ctx, sb.ID); err != nil || got.State != StateRunning {
		t.Fatalf("after the connect a holds %+v, %v; want it running", got, err)
	}
}
