package orchestrator

import (
	"context"
	"encoding/json"

	"github.com/aenv-dev/aenv/internal/catalog"
	"github.com/aenv-dev/aenv/internal/sandbox"
)

// publicationKnower is the part of *snapshot.Publisher that tells which catalog entries
// it has seen (published, journaled, in flight or synced).
type publicationKnower interface {
	Knows(id string) bool
}

// reconcileCaptures runs at Start, after the records were loaded (and those that did
// not survive dropped): the backend keeps only the captures that something references.
func (o *Orchestrator) reconcileCaptures(ctx context.Context) {
	r, ok := o.backend.(sandbox.CaptureReconciler)
	if !ok {
		return
	}
	tpls, err := o.cat.Templates().List("")
	if err != nil {
		// Without the catalog anything might be referenced: keep everything.
		o.log.Error("list templates to reconcile captures; keeping every capture", "err", err)
		return
	}
	var refs []json.RawMessage
	for _, t := range tpls {
		refs = append(refs, t.Artifact)
	}
	o.mu.Lock()
	for _, e := range o.entries {
		refs = append(refs, e.rec.DiskSnapshot, e.rec.Paused)
	}
	o.mu.Unlock()
	if err := r.ReconcileCaptures(ctx, refs); err != nil {
		o.log.Error("reconcile captures", "err", err)
	}
}

// publishMissed runs at Start: a snapshot registered in the catalog by this node but
// never handed to the publisher (the node died between the two) is published now, so
// every snapshot of the node reaches the repository. Snapshots the publisher knows
// (published, journaled, synced from another node) are its business.
func (o *Orchestrator) publishMissed(ctx context.Context) {
	k, ok := o.pub.(publicationKnower)
	if !ok {
		return
	}
	tpls, err := o.cat.Templates().List(catalog.KindSnapshot)
	if err != nil {
		o.log.Error("list snapshots to publish", "err", err)
		return
	}
	for _, t := range tpls {
		if (t.Backend != "" && t.Backend != o.backend.Name()) || k.Knows(t.ID) {
			continue
		}
		state := o.publish(ctx, t, o.cfg.EnvdVersion)
		o.log.Info("publishing a snapshot the last run registered but did not publish", "snapshot", t.ID, "publication", state)
	}
}
