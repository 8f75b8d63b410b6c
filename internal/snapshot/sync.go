package snapshot

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"math/rand/v2"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"time"

	"github.com/aenv-dev/aenv/internal/atomicfile"
	"github.com/aenv-dev/aenv/internal/catalog"
	"github.com/aenv-dev/aenv/internal/repository"
	"github.com/aenv-dev/aenv/internal/sandbox"
)

// SyncResult counts what one Sync did.
type SyncResult struct {
	Added, Updated, Removed []string
	// Deferred are entries whose record is gone but a sandbox here still
	// uses them; they are removed by a later sync once free.
	Deferred []string
}

// Sync brings the local catalog in step with the repository: complete
// records unknown here are registered (read lazily with LazyLayers, else
// with their layers fetched first; either way the entry is usable the
// moment it appears), new revisions of synced ones
// replace them, and entries whose record was deleted are removed once no
// sandbox here uses them. Pending records are ignored: other nodes use a
// record only when it is complete.
func (p *Publisher) Sync(ctx context.Context) (SyncResult, error) {
	p.syncMu.Lock()
	defer p.syncMu.Unlock()
	var res SyncResult
	known, err := p.trackedAll()
	if err != nil {
		return res, err
	}
	seen := map[string]bool{}
	var errs []error
	for _, kind := range repository.Kinds() {
		err := listAll(ctx, p.repo, kind, func(rec repository.Record) {
			seen[rec.ID] = true
			if rec.State != repository.StateComplete {
				return
			}
			t, ok := known[rec.ID]
			if !ok && IsHandoff(rec.ID) {
				// A paused sandbox of another node: registered only by the node
				// that claims it (ClaimHandoff).
				return
			}
			switch {
			case ok && t.Revision >= rec.Revision:
				return
			case ok && t.Local && slices.Equal(t.Digests, rec.Digests()):
				t.Revision = rec.Revision
				errs = append(errs, p.track(t))
				return
			case ok && t.Local:
				// Our record with other layers (merged by another node):
				// point the local entry at them.
				if _, err := p.cat.Get(rec.ID); err == nil {
					if err := p.register(ctx, rec, true); err != nil {
						errs = append(errs, err)
						return
					}
					res.Updated = append(res.Updated, rec.ID)
				}
				return
			case !ok:
				if _, err := p.cat.Get(rec.ID); err == nil {
					// Made here before tracking existed, or registered by
					// hand: the local entry wins; only track it.
					errs = append(errs, p.track(tracked{ID: rec.ID, Kind: rec.Kind, Revision: rec.Revision, Local: true, Digests: rec.Digests()}))
					return
				}
			}
			if err := p.register(ctx, rec, false); err != nil {
				errs = append(errs, fmt.Errorf("snapshot: sync %s: %w", rec.ID, err))
				return
			}
			if ok {
				res.Updated = append(res.Updated, rec.ID)
			} else {
				res.Added = append(res.Added, rec.ID)
			}
		})
		if err != nil {
			// Without the full list a missing record proves nothing.
			return res, fmt.Errorf("snapshot: sync: list %s records: %w", kind, err)
		}
	}
	for id := range known {
		if seen[id] || p.journaled(id) {
			continue
		}
		if p.o.InUse != nil && p.o.InUse(id) {
			res.Deferred = append(res.Deferred, id)
			continue
		}
		removed, err := p.cat.Delete(id)
		if err != nil && !errors.Is(err, catalog.ErrNotFound) {
			errs = append(errs, fmt.Errorf("snapshot: sync: remove %s: %w", id, err))
			continue
		}
		if err := p.untrack(id); err != nil {
			errs = append(errs, err)
			continue
		}
		res.Removed = append(res.Removed, id)
		if p.o.OnRemoved != nil && removed.ID != "" {
			p.o.OnRemoved(ctx, removed)
		}
	}
	if err := p.pruneLayers(); err != nil {
		errs = append(errs, err)
	}
	if len(res.Added)+len(res.Updated)+len(res.Removed) > 0 {
		p.log.Info("snapshot: catalog synced", "added", len(res.Added), "updated", len(res.Updated),
			"removed", len(res.Removed), "deferred", len(res.Deferred))
	}
	return res, errors.Join(errs...)
}

// listAll calls fn for every record of kind, page by page.
func listAll(ctx context.Context, repo repository.Repository, kind repository.Kind, fn func(repository.Record)) error {
	next := ""
	for {
		page, err := repo.ListRecords(ctx, kind, repository.ListOptions{After: next, Limit: repository.MaxListLimit})
		if err != nil {
			return err
		}
		for _, r := range page.Records {
			fn(r)
		}
		if page.Next == "" {
			return nil
		}
		next = page.Next
	}
}

// register puts rec's catalog entry: with LazyLayers at once, its layer
// refs by digest (see lazy.go), otherwise after fetching its layers to this
// node. With keepLocal the existing entry keeps its own fields and only its
// artifact's layer refs follow the record.
func (p *Publisher) register(ctx context.Context, rec repository.Record, keepLocal bool) error {
	var cfg recordConfig
	if len(rec.Config) > 0 {
		if err := json.Unmarshal(rec.Config, &cfg); err != nil {
			return fmt.Errorf("%w: record %s config: %v", ErrInvalid, rec.ID, err)
		}
	}
	var art json.RawMessage
	var err error
	if p.o.LazyLayers {
		// Before the entry appears: a sandbox may read its layers at once.
		for _, l := range rec.Layers {
			if err := p.hashes.Learn(ctx, p.repo, l); err != nil {
				return fmt.Errorf("snapshot: record %s: %w", rec.ID, err)
			}
		}
		art, err = withLazyPaths(cfg.Artifact, p.lazyPaths(rec))
	} else {
		byDigest := map[repository.Digest]string{}
		for _, l := range rec.Layers {
			path, err := p.materialize(ctx, l.Digest)
			if err != nil {
				return err
			}
			byDigest[l.Digest] = path
		}
		art, err = withPaths(cfg.Artifact, byDigest)
	}
	if err != nil {
		return err
	}
	t := catalog.Template{
		ID: rec.ID, Kind: catalog.KindTemplate,
		Resources:       sandbox.Resources{CPUCount: rec.Resources.CPUCount, MemoryMB: rec.Resources.MemoryMB, DiskSizeMB: rec.Resources.DiskSizeMB},
		EnvVars:         cfg.EnvVars,
		StartCmd:        cfg.StartCmd,
		ReadyCmd:        cfg.ReadyCmd,
		DefaultUser:     cfg.DefaultUser,
		DefaultWorkdir:  cfg.DefaultWorkdir,
		EnvdAccessToken: cfg.EnvdAccessToken,
		SourceSandboxID: rec.SourceSandboxID,
		ParentID:        rec.ParentSnapshotID,
		Backend:         rec.Backend,
		Artifact:        art,
		CreatedAt:       rec.CreatedAt,
	}
	if rec.Kind == repository.KindSnapshot {
		t.Kind = catalog.KindSnapshot
	}
	if rec.Name != "" {
		t.Aliases = []string{rec.Name}
	}
	if keepLocal {
		cur, err := p.cat.Get(rec.ID)
		if err != nil {
			return err
		}
		cur.Artifact = art
		t = cur
	}
	if err := p.putNamed(t); err != nil {
		return fmt.Errorf("snapshot: register %s: %w", rec.ID, err)
	}
	return p.track(tracked{ID: rec.ID, Kind: rec.Kind, Revision: rec.Revision, Local: keepLocal, Digests: rec.Digests()})
}

func (p *Publisher) layerPath(d repository.Digest) string {
	return p.path("layers", d.Hex()+".layer")
}

// materialize makes sure this node has a file with d's bytes and returns
// its path. The bytes come through repo (the node cache, when it is one),
// verified as they stream.
func (p *Publisher) materialize(ctx context.Context, d repository.Digest) (string, error) {
	path := p.layerPath(d)
	if _, err := os.Stat(path); err == nil {
		return path, nil
	}
	rc, err := p.repo.GetBlob(ctx, d)
	if err != nil {
		return "", fmt.Errorf("snapshot: fetch %s: %w", d, err)
	}
	defer rc.Close()
	// Layers are read-only: a sandbox writes to its own upper.
	err = atomicfile.Fill(path, ".fetch-", 0o444, func(f *os.File) error {
		_, err := io.Copy(f, rc)
		return err
	})
	if err != nil {
		return "", fmt.Errorf("snapshot: fetch %s: %w", d, err)
	}
	return path, nil
}

// cleanTmp removes the temporary files a crash left in the publisher's state:
// interrupted fetches (layers/.fetch-*) and atomic writes (.tmp-* in digests,
// records, publishing and blockhashes).
func (p *Publisher) cleanTmp() {
	for _, dir := range stateDirs() {
		ents, _ := os.ReadDir(p.path(dir))
		for _, e := range ents {
			if strings.HasPrefix(e.Name(), ".") {
				os.Remove(p.path(dir, e.Name()))
			}
		}
	}
}

// pruneLayers deletes fetched layers that no tracked record names and no
// node-cache pin (a live or paused sandbox) holds.
func (p *Publisher) pruneLayers() error {
	known, err := p.trackedAll()
	if err != nil {
		return err
	}
	keep := map[string]bool{}
	for _, t := range known {
		for _, d := range t.Digests {
			keep[d.Hex()] = true
		}
	}
	if p.local != nil {
		for _, d := range p.local.Pinned() {
			keep[d.Hex()] = true
		}
	}
	for _, d := range p.inFlight() {
		keep[d.Hex()] = true
	}
	ents, err := os.ReadDir(p.path("layers"))
	if err != nil {
		return fmt.Errorf("snapshot: %w", err)
	}
	for _, e := range ents {
		hex, ok := strings.CutSuffix(e.Name(), ".layer")
		if !ok || keep[hex] {
			continue
		}
		if err := os.Remove(filepath.Join(p.path("layers"), e.Name())); err != nil {
			p.log.Warn("snapshot: prune layer", "layer", e.Name(), "err", err)
		}
	}
	return nil
}

// loop syncs every SyncInterval (plus up to 10% jitter, so nodes sharing a
// repository do not list it in lockstep), merges deep stacks this node
// published and retries failed publications.
func (p *Publisher) loop(ctx context.Context) {
	for {
		jitter := time.Duration(rand.Int64N(int64(p.o.SyncInterval)/10 + 1))
		t := time.NewTimer(p.o.SyncInterval + jitter)
		select {
		case <-ctx.Done():
			t.Stop()
			return
		case <-t.C:
		}
		if _, err := p.Sync(ctx); err != nil && ctx.Err() == nil {
			p.log.Error("snapshot: sync", "err", err)
		}
		if _, err := p.Resume(ctx); err != nil && ctx.Err() == nil {
			p.log.Error("snapshot: resume publications", "err", err)
		}
		if err := p.CompactAll(ctx); err != nil && ctx.Err() == nil {
			p.log.Error("snapshot: compaction", "err", err)
		}
	}
}

// Fetch registers the complete record id (a template or snapshot another node published
// since the last sync) in the catalog at once, for a create that names it on this node
// before the background sync would have brought it. It reports whether id is in the
// catalog now. Handoffs are never fetched (ClaimHandoff is their only way in).
func (p *Publisher) Fetch(ctx context.Context, id string) (bool, error) {
	if repository.ValidateID(id) != nil || IsHandoff(id) {
		return false, nil
	}
	for _, kind := range repository.Kinds() {
		rec, err := p.repo.GetRecord(ctx, kind, id)
		if errors.Is(err, repository.ErrNotFound) {
			continue
		}
		if err != nil {
			return false, fmt.Errorf("snapshot: fetch %s: %w", id, err)
		}
		if rec.State != repository.StateComplete {
			return false, nil
		}
		p.syncMu.Lock()
		defer p.syncMu.Unlock()
		if _, err := p.cat.Get(id); err == nil {
			return true, nil // a sync won the race
		}
		if err := p.register(ctx, rec, false); err != nil {
			return false, err
		}
		p.log.Info("snapshot: fetched on demand", "id", id, "kind", kind)
		return true, nil
	}
	return false, nil
}
