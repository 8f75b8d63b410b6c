package orchestrator

import (
	"context"
	"encoding/json"
	"errors"
	"slices"
	"testing"
	"time"

	"github.com/aenv-dev/aenv/internal/catalog"
	"github.com/aenv-dev/aenv/internal/sandbox"
	"github.com/aenv-dev/aenv/internal/sandbox/mock"
)

// TestCaptureSandbox: a capture for the template builder leaves the sandbox running and
// registers nothing; the capture goes back to the backend through DiscardCapture, or
// with a removed template whose artifact keeps it.
func TestCaptureSandbox(t *testing.T) {
	ctx := context.Background()
	h := newHarness(t, snapModes[0].opts, nil)
	src := h.create(CreateRequest{Secure: true, Timeout: time.Minute})
	h.inst(src.ID).WriteFile("/built", []byte("yes"))

	raw, err := h.o.CaptureSandbox(ctx, src.ID)
	if err != nil {
		t.Fatal(err)
	}
	if !json.Valid(raw) {
		t.Fatalf("capture is not JSON: %s", raw)
	}
	if got := h.snapshotTemplates(); len(got) != 0 {
		t.Errorf("a capture registered snapshots: %+v", got)
	}
	if st := h.state(src.ID); st != StateRunning {
		t.Errorf("source is %s after the capture", st)
	}
	if err := h.o.DiscardCapture(ctx, raw); err != nil {
		t.Fatal(err)
	}
	if got := h.b.DiscardedSnapshots(); !slices.Equal(got, []string{src.ID}) {
		t.Errorf("discarded %q, want the capture of %s", got, src.ID)
	}

	// A built template keeps its capture in the artifact; removing it discards it.
	raw, err = h.o.CaptureSandbox(ctx, src.ID)
	if err != nil {
		t.Fatal(err)
	}
	art, _ := json.Marshal(map[string]any{"kind": "build-layers", "capture": raw})
	h.o.DiscardTemplate(ctx, catalog.Template{ID: "built", Kind: catalog.KindTemplate, Artifact: art})
	h.o.DiscardTemplate(ctx, catalog.Template{ID: "pulled", Kind: catalog.KindTemplate, Artifact: json.RawMessage(`{"kind":"oci-image"}`)})
	if got := h.b.DiscardedSnapshots(); len(got) != 2 {
		t.Errorf("discarded %q after removing a built and a pulled template, want 2 captures", got)
	}

	if _, err := h.o.CaptureSandbox(ctx, "nope"); !errors.Is(err, ErrNotFound) {
		t.Errorf("capture of an unknown sandbox: %v", err)
	}
	if err := h.o.DiscardCapture(ctx, json.RawMessage(`{"not":"a capture"`)); err == nil {
		t.Error("discard of garbage succeeded")
	}
}

// TestCaptureSandboxUnsupported: a backend that cannot snapshot says so.
func TestCaptureSandboxUnsupported(t *testing.T) {
	h := newHarness(t, mock.Options{Capabilities: sandbox.Capabilities{PauseKeepsProcesses: true}}, nil)
	src := h.create(CreateRequest{Timeout: time.Minute})
	if _, err := h.o.CaptureSandbox(context.Background(), src.ID); !errors.Is(err, ErrUnsupported) {
		t.Errorf("capture without snapshots: %v", err)
	}
	if st := h.state(src.ID); st != StateRunning {
		t.Errorf("source is %s", st)
	}
}
