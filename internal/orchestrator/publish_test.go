package orchestrator

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/aenv-dev/aenv/internal/catalog"
	"github.com/aenv-dev/aenv/internal/repository"
	"github.com/aenv-dev/aenv/internal/sandbox"
	"github.com/aenv-dev/aenv/internal/sandbox/mock"
	"github.com/aenv-dev/aenv/internal/snapshot"
)

// fakePublisher records the orchestrator's publisher calls in order and fails those
// told to.
type fakePublisher struct {
	mu     sync.Mutex
	calls  []string
	fail   map[string]error // by call kind: "publish", "delete", "pin", "unpin"
	owners []string         // PinOwners
	// onCall, when set, runs inside each call (to look at the orchestrator then).
	onCall func(call string)
	tpls   []catalog.Template // what PublishTemplate was given
}

func (f *fakePublisher) record(kind, call string) error {
	f.mu.Lock()
	f.calls = append(f.calls, call)
	err, hook := f.fail[kind], f.onCall
	f.mu.Unlock()
	if hook != nil {
		hook(call)
	}
	return err
}

func (f *fakePublisher) PublishTemplate(_ context.Context, t catalog.Template, envdVersion string) (*snapshot.Handle, error) {
	f.mu.Lock()
	f.tpls = append(f.tpls, t)
	f.mu.Unlock()
	return nil, f.record("publish", fmt.Sprintf("publish %s %s envd=%s", t.ID, t.Kind, envdVersion))
}

func (f *fakePublisher) Delete(_ context.Context, id string) (repository.GCResult, error) {
	return repository.GCResult{}, f.record("delete", "delete "+id)
}

func (f *fakePublisher) PinSandbox(sandboxID, templateID string) error {
	return f.record("pin", "pin "+sandboxID+" "+templateID)
}

func (f *fakePublisher) UnpinSandbox(sandboxID string) error {
	return f.record("unpin", "unpin "+sandboxID)
}

func (f *fakePublisher) PinOwners() []string {
	f.mu.Lock()
	defer f.mu.Unlock()
	return slices.Clone(f.owners)
}

// take returns the calls recorded since the last take.
func (f *fakePublisher) take() []string {
	f.mu.Lock()
	defer f.mu.Unlock()
	out := f.calls
	f.calls = nil
	return out
}

// newPubHarness is a harness on a snapshotting mock backend whose orchestrator has f as
// its publisher and pin lister.
func newPubHarness(t *testing.T, f *fakePublisher) *harness {
	t.Helper()
	h := newHarness(t, snapModes[0].opts, nil)
	h.opts = []Option{WithPublisher(f, f)}
	h.restart()
	f.take()
	return h
}

func TestPublisherCallsFollowTheLifecycle(t *testing.T) {
	ctx := context.Background()
	f := &fakePublisher{}
	h := newPubHarness(t, f)

	src := h.create(CreateRequest{Secure: true})
	if got, want := f.take(), []string{"pin " + src.ID + " base"}; !slices.Equal(got, want) {
		t.Fatalf("create: calls %q, want %q", got, want)
	}

	// The snapshot is in the catalog when it is published, and published before the
	// snapshot call returns.
	inCatalog := false
	f.onCall = func(call string) {
		if id, ok := strings.CutPrefix(call, "publish "); ok {
			_, err := h.cat.Templates().Get(strings.Fields(id)[0])
			inCatalog = err == nil
		}
	}
	info, err := h.o.Snapshot(ctx, src.ID, "golden")
	if err != nil {
		t.Fatal(err)
	}
	f.onCall = nil
	want := []string{fmt.Sprintf("publish %s snapshot envd=%s", info.SnapshotID, src.EnvdVersion)}
	if got := f.take(); !slices.Equal(got, want) || !inCatalog {
		t.Fatalf("snapshot: calls %q (in catalog: %v), want %q", got, inCatalog, want)
	}
	if info.Publication != PublicationPending {
		t.Fatalf("snapshot publication %q, want %q", info.Publication, PublicationPending)
	}
	if tpl := f.tpls[0]; tpl.SourceSandboxID != src.ID || len(tpl.Artifact) == 0 || !slices.Equal(tpl.Aliases, []string{"golden"}) {
		t.Fatalf("published template %+v", tpl)
	}

	child := h.create(CreateRequest{TemplateID: "golden"})
	if got, want := f.take(), []string{"pin " + child.ID + " " + info.SnapshotID}; !slices.Equal(got, want) {
		t.Fatalf("create from snapshot: calls %q, want %q", got, want)
	}
	if !h.o.UsesTemplate(info.SnapshotID) || !h.o.UsesTemplate("base") || h.o.UsesTemplate("other") {
		t.Fatal("UsesTemplate does not see the sandboxes' templates")
	}

	// Fork registers no snapshot: nothing is published; each child pins its lineage.
	res, err := h.o.Fork(ctx, child.ID, 2, 0)
	if err != nil {
		t.Fatal(err)
	}
	got := f.take()
	slices.Sort(got)
	want = []string{"pin " + res[0].Sandbox.ID + " " + info.SnapshotID, "pin " + res[1].Sandbox.ID + " " + info.SnapshotID}
	slices.Sort(want)
	if !slices.Equal(got, want) {
		t.Fatalf("fork: calls %q, want %q", got, want)
	}

	for _, id := range []string{child.ID, res[0].Sandbox.ID, res[1].Sandbox.ID} {
		if err := h.o.Kill(ctx, id); err != nil {
			t.Fatal(err)
		}
		if got, want := f.take(), []string{"unpin " + id}; !slices.Equal(got, want) {
			t.Fatalf("kill: calls %q, want %q", got, want)
		}
	}
	if h.o.UsesTemplate(info.SnapshotID) {
		t.Fatal("UsesTemplate reports a snapshot no sandbox uses any more")
	}

	// Deleted from the repository after the catalog, by id even when named.
	f.onCall = func(call string) {
		if strings.HasPrefix(call, "delete ") {
			_, err := h.cat.Templates().Get(info.SnapshotID)
			inCatalog = err == nil
		}
	}
	if err := h.o.DeleteTemplate(ctx, "golden"); err != nil {
		t.Fatal(err)
	}
	if got, want := f.take(), []string{"delete " + info.SnapshotID}; !slices.Equal(got, want) || inCatalog {
		t.Fatalf("delete: calls %q (still in catalog: %v), want %q", got, inCatalog, want)
	}
}

func TestPublisherErrorsNeverFailTheOperation(t *testing.T) {
	ctx := context.Background()
	boom := errors.New("repository unreachable")
	tests := []struct {
		name            string
		fail            map[string]error
		wantPublication string
	}{
		{"publish fails", map[string]error{"publish": boom}, PublicationFailed},
		{"nothing to publish", map[string]error{"publish": fmt.Errorf("%w: directory template", snapshot.ErrInvalid)}, PublicationNone},
		{"pins fail", map[string]error{"pin": boom, "unpin": boom}, PublicationPending},
		{"delete fails", map[string]error{"delete": boom}, PublicationPending},
		{"delete of an unpublished snapshot", map[string]error{"delete": snapshot.ErrNotFound}, PublicationPending},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			f := &fakePublisher{fail: tc.fail}
			h := newPubHarness(t, f)
			src := h.create(CreateRequest{})
			info, err := h.o.Snapshot(ctx, src.ID, "")
			if err != nil {
				t.Fatalf("snapshot: %v", err)
			}
			if info.Publication != tc.wantPublication {
				t.Fatalf("publication %q, want %q", info.Publication, tc.wantPublication)
			}
			child := h.create(CreateRequest{TemplateID: info.SnapshotID})
			if _, err := h.o.Fork(ctx, src.ID, 1, 0); err != nil {
				t.Fatalf("fork: %v", err)
			}
			if err := h.o.Kill(ctx, child.ID); err != nil {
				t.Fatalf("kill: %v", err)
			}
			if h.state(child.ID) != "" {
				t.Fatal("killed sandbox still listed")
			}
			if err := h.o.DeleteTemplate(ctx, info.SnapshotID); err != nil {
				t.Fatalf("delete: %v", err)
			}
			if _, err := h.cat.Templates().Get(info.SnapshotID); !errors.Is(err, catalog.ErrNotFound) {
				t.Fatalf("snapshot still in the catalog: %v", err)
			}
			if got := h.b.DiscardedSnapshots(); !slices.Contains(got, src.ID) {
				t.Fatalf("capture of the deleted snapshot not discarded: %v", got)
			}
		})
	}
}

// A pin that fails before the launch does not stop it, and a launch that fails after
// the pin releases it.
func TestFailedCreateReleasesItsPin(t *testing.T) {
	f := &fakePublisher{}
	h := newPubHarness(t, f)
	h.b.Fail(mock.StageLaunch, errors.New("no capacity"), 1)
	if _, err := h.o.Create(context.Background(), CreateRequest{TemplateID: "base"}); err == nil {
		t.Fatal("create succeeded despite the launch failure")
	}
	got := f.take()
	if len(got) != 2 || !strings.HasPrefix(got[0], "pin ") || got[1] != "unpin "+strings.Fields(got[0])[1] {
		t.Fatalf("failed create: calls %q, want a pin then its unpin", got)
	}
}

func TestRestartReconcilesPins(t *testing.T) {
	f := &fakePublisher{}
	h := newPubHarness(t, f)
	pinnedLive := h.create(CreateRequest{})
	unpinnedLive := h.create(CreateRequest{})
	paused := h.create(CreateRequest{})
	if err := h.o.Pause(context.Background(), paused.ID, sandbox.PauseOptions{KeepMemory: true}); err != nil {
		t.Fatal(err)
	}
	gone := h.create(CreateRequest{})
	h.b.Vanish(gone.ID) // dies with the node
	f.take()

	f.owners = []string{pinnedLive.ID, paused.ID, gone.ID, "publish-snap1", "someoneelse"}
	h.restart()
	got := f.take()
	slices.Sort(got)
	want := []string{"pin " + unpinnedLive.ID + " base", "unpin " + gone.ID, "unpin someoneelse"}
	slices.Sort(want)
	if !slices.Equal(got, want) {
		t.Fatalf("restart: calls %q, want %q", got, want)
	}
	if h.state(paused.ID) != StatePaused || h.state(pinnedLive.ID) != StateRunning {
		t.Fatal("restart lost sandboxes")
	}
}

// Without a publisher nothing changes: snapshots are local and report so.
func TestNoPublisher(t *testing.T) {
	h := newHarness(t, snapModes[0].opts, nil)
	src := h.create(CreateRequest{})
	info, err := h.o.Snapshot(context.Background(), src.ID, "")
	if err != nil || info.Publication != PublicationNone {
		t.Fatalf("snapshot %+v, %v", info, err)
	}
	if err := h.o.DeleteTemplate(context.Background(), info.SnapshotID); err != nil {
		t.Fatal(err)
	}
	if err := h.o.Kill(context.Background(), src.ID); err != nil {
		t.Fatal(err)
	}
}

// A delete of a snapshot that overtakes its registration waits for its publication, so
// the snapshot cannot stay in the repository after the delete returned.
func TestDeleteWaitsForPublication(t *testing.T) {
	f := &fakePublisher{}
	h := newPubHarness(t, f)
	src := h.create(CreateRequest{})
	release := make(chan struct{})
	entered := make(chan string, 1)
	f.onCall = func(call string) {
		if strings.HasPrefix(call, "publish ") {
			entered <- strings.Fields(call)[1]
			<-release
		}
	}
	done := make(chan error, 1)
	go func() { _, err := h.o.Snapshot(context.Background(), src.ID, "race"); done <- err }()
	id := <-entered
	deleted := make(chan error, 1)
	go func() { deleted <- h.o.DeleteTemplate(context.Background(), "race") }()
	select {
	case err := <-deleted:
		t.Fatalf("delete returned (%v) while the publication was starting", err)
	case <-time.After(50 * time.Millisecond):
	}
	close(release)
	if err := <-done; err != nil {
		t.Fatal(err)
	}
	if err := <-deleted; err != nil {
		t.Fatal(err)
	}
	calls := f.take()
	if i, j := slices.Index(calls, "delete "+id), slices.IndexFunc(calls, func(c string) bool { return strings.HasPrefix(c, "publish "+id) }); i < 0 || j < 0 || i < j {
		t.Fatalf("calls %q: want the publish of %s before its delete", calls, id)
	}
}
