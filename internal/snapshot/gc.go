package snapshot

import (
	"context"
	"errors"
	"fmt"
	"os"
	"slices"

	"github.com/aenv-dev/aenv/internal/catalog"
	"github.com/aenv-dev/aenv/internal/repository"
)

// Delete removes template or snapshot id from the repository and this
// node's catalog, then collects the blobs nothing references any more.
//
// Lineage: snapshots made from id (its children) do not stop the delete.
// Layers are shared, not owned: a child's record names every layer of its
// stack, so GC keeps what children (and templates, pending publications and
// pins of live or paused sandboxes) still use and frees only the rest.
// A publication of id in flight is cancelled. Deleting an unknown id is
// ErrNotFound.
func (p *Publisher) Delete(ctx context.Context, id string) (repository.GCResult, error) {
	if err := repository.ValidateID(id); err != nil {
		return repository.GCResult{}, fmt.Errorf("%w: %v", ErrNotFound, err)
	}
	// Not while a sync registers what this deletes.
	p.syncMu.Lock()
	defer p.syncMu.Unlock()
	p.mu.Lock()
	j := p.jobs[id]
	delete(p.jobs, id)
	p.mu.Unlock()
	if j != nil {
		j.cancel()
		<-j.done
	}
	journaled := p.journaled(id)
	os.Remove(p.path("publishing", id+".json"))
	if p.local != nil {
		if err := p.local.Unpin(pinOwner(id)); err != nil {
			return repository.GCResult{}, err
		}
	}
	found := journaled
	for _, k := range repository.Kinds() {
		_, err := p.repo.GetRecord(ctx, k, id)
		if errors.Is(err, repository.ErrNotFound) {
			continue
		}
		if err != nil {
			return repository.GCResult{}, fmt.Errorf("snapshot: delete %s: %w", id, err)
		}
		found = true
		if err := p.repo.DeleteRecord(ctx, k, id); err != nil {
			return repository.GCResult{}, fmt.Errorf("snapshot: delete %s: %w", id, err)
		}
	}
	if _, err := p.cat.Delete(id); err == nil {
		found = true
	} else if !errors.Is(err, catalog.ErrNotFound) {
		return repository.GCResult{}, fmt.Errorf("snapshot: delete %s from the catalog: %w", id, err)
	}
	if _, ok := p.tracked(id); ok {
		found = true
	}
	if err := p.untrack(id); err != nil {
		return repository.GCResult{}, err
	}
	if !found {
		return repository.GCResult{}, fmt.Errorf("%w: %s", ErrNotFound, id)
	}
	if err := p.pruneLayers(); err != nil {
		p.log.Warn("snapshot: prune layers", "err", err)
	}
	res, err := p.GC(ctx)
	if err != nil {
		// The record is gone; the next GC frees its blobs.
		p.log.Warn("snapshot: gc after delete", "id", id, "err", err)
	}
	return res, nil
}

// GC collects repository blobs that no record, no publication in flight
// here and no pin of this node's cache references, sparing blobs put within
// the grace period (publications in progress on other nodes).
func (p *Publisher) GC(ctx context.Context) (repository.GCResult, error) {
	pinned := p.inFlight()
	if p.local != nil {
		pinned = append(pinned, p.local.Pinned()...)
	}
	pinned = append(pinned, p.blockHashesOf(pinned)...)
	slices.Sort(pinned)
	return repository.GC(ctx, p.repo, repository.GCOptions{Pinned: slices.Compact(pinned), Grace: p.o.GCGrace, Logger: p.log})
}

// PinSandbox pins, in the node cache, every layer of the template or
// snapshot a sandbox runs on (owner = the sandbox id), so neither eviction
// nor this node's GC frees them while the sandbox is live or paused. Call
// UnpinSandbox when the sandbox is deleted. Templates this node never
// published or synced have nothing to pin and are not an error.
func (p *Publisher) PinSandbox(sandboxID, templateID string) error {
	if p.local == nil {
		return nil
	}
	t, ok := p.tracked(templateID)
	if !ok {
		return nil
	}
	return p.local.Pin(sandboxID, t.Digests...)
}

// UnpinSandbox drops a sandbox's pins.
func (p *Publisher) UnpinSandbox(sandboxID string) error {
	if p.local == nil {
		return nil
	}
	return p.local.Unpin(sandboxID)
}
