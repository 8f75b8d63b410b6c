package orchestrator

import (
	"context"
	"encoding/json"
	"fmt"
	"time"

	"github.com/aenv-dev/aenv/internal/catalog"
	"github.com/aenv-dev/aenv/internal/sandbox"
)

// CaptureSandbox seals a running sandbox's root filesystem into layers the way Snapshot
// does (the sandbox keeps running, same id and tokens) but registers nothing: the
// caller, the template builder, makes a template of the encoded capture and owns it.
// It hands the capture back to DiscardCapture when no template references it any more,
// or keeps it in the template's artifact under "capture" (see DiscardTemplate).
//
// Errors as Snapshot's: ErrUnsupported where the backend cannot capture this sandbox
// (a directory root), ErrConflict, ErrNotFound.
func (o *Orchestrator) CaptureSandbox(ctx context.Context, id string) (json.RawMessage, error) {
	start := time.Now()
	m := o.m
	o.mu.Lock()
	if e := o.entries[id]; e != nil {
		m = o.metricsFor(e.rec.Metadata)
	}
	o.mu.Unlock()
	raw, err := o.captureSandbox(ctx, id)
	m.observe(opSnapshot, stageTotal, start, err)
	if err != nil && !clientError(err) {
		m.failures.WithLabelValues(opSnapshot).Inc()
		o.log.Error("capture sandbox", "sandbox", id, "err", err)
	}
	return raw, err
}

func (o *Orchestrator) captureSandbox(ctx context.Context, id string) (json.RawMessage, error) {
	if !o.backend.Capabilities().Snapshots {
		return nil, fmt.Errorf("%w: backend %s cannot snapshot sandboxes", ErrUnsupported, o.backend.Name())
	}
	e, err := o.acquireRunning(ctx, id)
	if err != nil {
		return nil, err
	}
	p, _ := o.begin(e, StateSnapshotting)
	octx, cancel := o.opContext(ctx)
	defer cancel()
	_, raw, err := o.capture(octx, opSnapshot, e, p)
	if err != nil {
		return nil, err
	}
	o.finish(e, p, StateRunning, nil)
	return raw, nil
}

// DiscardCapture tells the backend that a capture CaptureSandbox returned is no longer
// referenced. Layers that sandboxes or other captures still use stay until they are
// free. A backend without captures to discard makes it a no-op.
func (o *Orchestrator) DiscardCapture(ctx context.Context, raw json.RawMessage) error {
	if _, ok := o.backend.(sandbox.SnapshotDiscarder); !ok || len(raw) == 0 {
		return nil
	}
	c, err := o.backend.DecodeCaptured(raw)
	if err != nil {
		return fmt.Errorf("decode capture: %w", err)
	}
	o.discardCapture(ctx, c)
	return nil
}

// templateCapture is the member of a built template's artifact that holds the backend
// capture it was made from (the template builder's "capture").
type templateCapture struct {
	Capture json.RawMessage `json:"capture"`
}

// discardBuiltTemplate frees the capture a removed template (kind template) was built
// from, if it has one; templates without one (pulled images, directories) hold nothing
// of the backend's.
func (o *Orchestrator) discardBuiltTemplate(ctx context.Context, t catalog.Template) {
	var a templateCapture
	if len(t.Artifact) == 0 || json.Unmarshal(t.Artifact, &a) != nil || len(a.Capture) == 0 || string(a.Capture) == "null" {
		return
	}
	if err := o.DiscardCapture(ctx, a.Capture); err != nil {
		// The record is gone; the backend's reconcile drops what nothing references.
		o.log.Error("discard the capture of a removed template", "template", t.ID, "err", err)
	}
}

// UsesRootFSDir reports whether a sandbox of this node runs on the directory template
// root dir (its overlay's lower), so that a replaced template's files stay until the
// last such sandbox is gone.
func (o *Orchestrator) UsesRootFSDir(dir string) bool {
	o.mu.Lock()
	defer o.mu.Unlock()
	for _, e := range o.entries {
		if e.rec.Launch.RootFS.LowerDir == dir {
			return true
		}
	}
	return false
}
