package orchestrator

import (
	"context"
	"encoding/json"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/aenv-dev/aenv/internal/catalog"
	"github.com/aenv-dev/aenv/internal/sandbox"
	"github.com/aenv-dev/aenv/internal/sandbox/mock"
	"github.com/aenv-dev/aenv/internal/snapshot"
)

// reconcilingBackend is the mock backend with CaptureReconciler: it records what Start
// says is referenced.
type reconcilingBackend struct {
	*mock.Backend
	mu    sync.Mutex
	calls [][]json.RawMessage
}

var _ sandbox.CaptureReconciler = (*reconcilingBackend)(nil)

func (b *reconcilingBackend) ReconcileCaptures(_ context.Context, referenced []json.RawMessage) error {
	b.mu.Lock()
	defer b.mu.Unlock()
	b.calls = append(b.calls, referenced)
	return nil
}

// knowingPublisher is the fake publisher with Knows: it knows what it was asked to
// publish, less what the test makes it forget.
type knowingPublisher struct {
	*fakePublisher
	mu    sync.Mutex
	known map[string]bool
}

func (k *knowingPublisher) PublishTemplate(ctx context.Context, t catalog.Template, envdVersion string) (*snapshot.Handle, error) {
	k.mu.Lock()
	k.known[t.ID] = true
	k.mu.Unlock()
	return k.fakePublisher.PublishTemplate(ctx, t, envdVersion)
}

func (k *knowingPublisher) Knows(id string) bool {
	k.mu.Lock()
	defer k.mu.Unlock()
	return k.known[id]
}

// After a crash mid-snapshot, Start hands the backend every artifact still referenced
// (catalog entries, disk-paused records; not those of sandboxes that did not survive),
// and publishes the snapshots registered but never handed to the publisher, and only
// those.
func TestStartReconcilesCapturesAndPublishesMissed(t *testing.T) {
	ctx := context.Background()
	f := &fakePublisher{}
	kp := &knowingPublisher{fakePublisher: f, known: map[string]bool{}}
	h := newHarness(t, snapModes[0].opts, nil)
	var rb *reconcilingBackend
	h.wrap = func(b *mock.Backend) sandbox.Backend {
		rb = &reconcilingBackend{Backend: b}
		return rb
	}
	h.opts = []Option{WithPublisher(kp, f)}
	h.restart()

	src := h.create(CreateRequest{Timeout: time.Hour})
	published, err := h.o.Snapshot(ctx, src.ID, "published")
	if err != nil {
		t.Fatal(err)
	}
	missed, err := h.o.Snapshot(ctx, src.ID, "missed")
	if err != nil {
		t.Fatal(err)
	}
	kp.mu.Lock()
	delete(kp.known, missed.SnapshotID) // the node died before it reached the publisher
	kp.mu.Unlock()
	paused := h.create(CreateRequest{Timeout: time.Hour})
	if err := h.o.Pause(ctx, paused.ID, sandbox.PauseOptions{}); err != nil {
		t.Fatal(err)
	}
	h.o.mu.Lock()
	disk := h.o.entries[paused.ID].rec.DiskSnapshot
	h.o.mu.Unlock()
	if len(disk) == 0 {
		t.Fatal("pause to disk recorded no disk snapshot")
	}
	f.take()

	h.restart()
	var publishes []string
	for _, c := range f.take() {
		if strings.HasPrefix(c, "publish ") {
			publishes = append(publishes, strings.Fields(c)[1])
		}
	}
	if !slices.Equal(publishes, []string{missed.SnapshotID}) {
		t.Errorf("Start published %v, want only the missed snapshot %s", publishes, missed.SnapshotID)
	}
	rb.mu.Lock()
	calls := rb.calls
	rb.mu.Unlock()
	if len(calls) != 1 {
		t.Fatalf("ReconcileCaptures called %d times at Start, want 1", len(calls))
	}
	has := func(raw json.RawMessage) bool {
		return slices.ContainsFunc(calls[0], func(r json.RawMessage) bool { return string(r) == string(raw) })
	}
	for _, id := range []string{published.SnapshotID, missed.SnapshotID} {
		tpl, err := h.cat.Templates().Get(id)
		if err != nil {
			t.Fatal(err)
		}
		if len(tpl.Artifact) == 0 || !has(tpl.Artifact) {
			t.Errorf("the artifact of snapshot %s is not among the referenced ones", id)
		}
	}
	if !has(disk) {
		t.Error("the disk snapshot of the paused sandbox is not among the referenced ones")
	}
}
