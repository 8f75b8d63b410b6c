package snapshot

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"slices"
	"time"

	"golang.org/x/sync/errgroup"

	"github.com/aenv-dev/aenv/internal/repository"
	"github.com/aenv-dev/aenv/internal/repository/nodecache"
)

// pinOwner names the node-cache pin of a publication in flight.
func pinOwner(id string) string { return "publish-" + id }

// digests lists the distinct digests of the job's layers once hashed.
func (j *job) digests() []repository.Digest {
	j.mu.Lock()
	defer j.mu.Unlock()
	return slices.Clone(j.hashed)
}

// run publishes j.m: hash, cache locally, pending record, upload, check,
// complete. The journal is removed when the publication ends for good
// (complete, or failed in a way a retry cannot fix).
func (p *Publisher) run(ctx context.Context, j *job) (err error) {
	m := j.m
	permanent := false
	var pending *repository.Record // our pending record, once written
	defer func() {
		if err != nil && permanent && ctx.Err() == nil && pending != nil {
			// It can never complete: drop it so GC may free its blobs.
			if derr := p.repo.DeleteRecord(context.WithoutCancel(ctx), pending.Kind, pending.ID); derr != nil {
				p.log.Warn("snapshot: delete failed publication's record", "id", m.ID, "err", derr)
			}
			_ = p.untrack(m.ID)
		}
		// A cancelled publication (shutdown, Delete) keeps its journal:
		// shutdown resumes it at the next start, Delete removes it.
		if err == nil || permanent && ctx.Err() == nil {
			os.Remove(p.path("publishing", m.ID+".json"))
			if p.local != nil {
				if uerr := p.local.Unpin(pinOwner(m.ID)); uerr != nil {
					p.log.Warn("snapshot: unpin publication", "id", m.ID, "err", uerr)
				}
			}
		}
	}()

	// 1. Digests (remembered per file, so a resumed publication does not
	// hash again).
	layers := make([]repository.Layer, len(m.Layers))
	byPath := map[string]repository.Digest{}
	files := map[repository.Digest]LayerFile{}
	var distinct []repository.Digest
	for i, l := range m.Layers {
		d, n, derr := p.layerDigest(ctx, l)
		if derr != nil {
			if cached := p.cachedByPath(l.Path); cached != "" && errors.Is(derr, fs.ErrNotExist) {
				// The file is gone (its sandbox discarded it) but a
				// previous run of this publication cached its bytes.
				d, n = cached, p.cachedSize(l.Path)
			} else {
				permanent = !isTransient(derr)
				return derr
			}
		}
		layers[i] = repository.Layer{Role: l.Role, Digest: d, Size: n, UUID: l.UUID}
		if layers[i].BlockHashes, err = p.blockHashes(ctx, d, l); err != nil {
			permanent = !isTransient(err)
			return err
		}
		if l.Path != "" {
			byPath[l.Path] = d
		}
		if _, ok := files[d]; !ok {
			files[d] = l
			distinct = append(distinct, d)
		}
	}
	j.update(func(s *Status) { s.Blobs = len(distinct) })
	j.mu.Lock()
	j.hashed = distinct
	j.mu.Unlock()

	// 2. Layers the repository already has (a template's, a parent
	// snapshot's) are deduplicated: only new ones are copied and uploaded.
	// GC may still remove such a blob before the pending record names it;
	// the check in step 4 puts it back.
	toPut, err := p.missing(ctx, distinct)
	if err != nil {
		return err
	}
	j.update(func(s *Status) { s.Uploaded = len(distinct) - len(toPut) })

	// Pin and copy the new ones into the node cache: this node reads them
	// locally from now on, and the upload reads the cache, not files a
	// sandbox might discard meanwhile.
	if p.local != nil {
		if err := p.local.Pin(pinOwner(m.ID), distinct...); err != nil {
			return fmt.Errorf("snapshot: pin %s: %w", m.ID, err)
		}
		for _, d := range toPut {
			if err := p.putLocal(ctx, d, files[d], layers); err != nil {
				permanent = !isTransient(err)
				return err
			}
		}
	}

	// 3. The pending record names every digest: from here on GC keeps them.
	art, err := withDigests(m.Config.Artifact, byPath)
	if err != nil {
		permanent = true
		return err
	}
	cfg := recordConfig{Node: p.o.NodeID, Defaults: m.Config}
	cfg.Artifact = art
	rawCfg, err := json.Marshal(cfg)
	if err != nil {
		permanent = true
		return fmt.Errorf("snapshot: %w", err)
	}
	rec := repository.Record{Kind: m.Kind, ID: m.ID, Name: m.Name, State: repository.StatePending, Layers: layers,
		Resources: m.Resources, Config: rawCfg, EnvdVersion: m.EnvdVersion, Backend: m.Backend,
		SourceSandboxID: m.SourceSandbox, ParentSnapshotID: m.ParentSnapshot, CreatedAt: m.CreatedAt}
	stored, done, err := p.putPending(ctx, rec)
	if err != nil {
		permanent = !isTransient(err)
		return err
	}
	pending = &stored
	if err := p.track(tracked{ID: m.ID, Kind: m.Kind, Revision: stored.Revision, Local: true, Digests: rec.Digests()}); err != nil {
		return err
	}
	if done {
		return nil
	}

	// 4. Upload, then check every blob is there: GC may have removed one
	// that was deduplicated just before the pending record appeared.
	for round := 0; ; round++ {
		if err := p.uploadAll(ctx, j, toPut, files); err != nil {
			permanent = !isTransient(err)
			return err
		}
		if err := p.putBlockHashes(ctx, layers); err != nil {
			permanent = !isTransient(err)
			return err
		}
		missing, err := p.missing(ctx, distinct)
		if err != nil {
			return err
		}
		if len(missing) == 0 {
			break
		}
		if round == 2 {
			return fmt.Errorf("snapshot: %d blobs of %s vanish from the repository after upload", len(missing), m.ID)
		}
		toPut = missing
	}

	// 5. Complete: other nodes may use it now.
	stored.State = repository.StateComplete
	err = p.retry(ctx, "complete "+m.ID, func() error {
		var perr error
		stored, perr = p.repo.PutRecord(ctx, stored)
		return perr
	})
	if errors.Is(err, repository.ErrNotFound) || errors.Is(err, repository.ErrConflict) {
		// Deleted, or replaced by a writer that did not see ours: the
		// record is not ours to remove.
		permanent, pending = true, nil
		return fmt.Errorf("%w: %s: %v", ErrDeleted, m.ID, err)
	}
	if err != nil {
		return err
	}
	return p.track(tracked{ID: m.ID, Kind: m.Kind, Revision: stored.Revision, Local: true, Digests: rec.Digests()})
}

// putLocal copies one layer into the node cache; a full cache is not an
// error (the upload then reads the file).
func (p *Publisher) putLocal(ctx context.Context, d repository.Digest, l LayerFile, layers []repository.Layer) error {
	f, err := os.Open(l.Path)
	if errors.Is(err, fs.ErrNotExist) && p.cached(d) {
		return nil
	}
	if err != nil {
		return fmt.Errorf("snapshot: layer %s: %w", l.Path, err)
	}
	defer f.Close()
	var size int64 = -1
	for _, x := range layers {
		if x.Digest == d {
			size = x.Size
		}
	}
	_, err = p.local.PutLocal(ctx, d, size, f)
	switch {
	case err == nil, errors.Is(err, nodecache.ErrCacheFull):
		return nil
	case errors.Is(err, repository.ErrDigestMismatch):
		p.dg.forget(l.Path)
		return fmt.Errorf("snapshot: layer %s changed since it was hashed: %w", l.Path, err)
	}
	return fmt.Errorf("snapshot: cache %s: %w", l.Path, err)
}

func (p *Publisher) cached(d repository.Digest) bool {
	c, ok := p.local.(interface{ Cached(repository.Digest) bool })
	return ok && c.Cached(d)
}

// cachedByPath finds, for a resumed publication whose layer file is gone,
// the digest its previous run recorded for that path.
func (p *Publisher) cachedByPath(path string) repository.Digest {
	if p.local == nil {
		return ""
	}
	if b, err := os.ReadFile(p.dg.entryPath(path)); err == nil {
		var k knownDigest
		if json.Unmarshal(b, &k) == nil && k.Path == path && p.cached(k.Digest) {
			return k.Digest
		}
	}
	return ""
}

func (p *Publisher) cachedSize(path string) int64 {
	b, _ := os.ReadFile(p.dg.entryPath(path))
	var k knownDigest
	_ = json.Unmarshal(b, &k)
	return k.Size
}

// putPending creates the pending record, or adopts the one a previous run
// of this node left (done is true when that one is already complete).
func (p *Publisher) putPending(ctx context.Context, rec repository.Record) (repository.Record, bool, error) {
	var stored repository.Record
	err := p.retry(ctx, "record "+rec.ID, func() error {
		var perr error
		stored, perr = p.repo.PutRecord(ctx, rec)
		return perr
	})
	if !errors.Is(err, repository.ErrExists) {
		return stored, false, err
	}
	old, err := p.repo.GetRecord(ctx, rec.Kind, rec.ID)
	if err != nil {
		return old, false, fmt.Errorf("snapshot: record %s: %w", rec.ID, err)
	}
	var cfg recordConfig
	_ = json.Unmarshal(old.Config, &cfg)
	if cfg.Node != p.o.NodeID {
		return old, false, fmt.Errorf("%w: %s %s was published by node %q", repository.ErrExists, rec.Kind, rec.ID, cfg.Node)
	}
	if slices.Equal(old.Digests(), rec.Digests()) {
		// Our own record from an interrupted run: carry on from it.
		return old, old.State == repository.StateComplete, nil
	}
	rec.Revision = old.Revision
	stored, err = p.repo.PutRecord(ctx, rec)
	if err != nil {
		return stored, false, fmt.Errorf("snapshot: record %s: %w", rec.ID, err)
	}
	return stored, false, nil
}

// uploadAll puts every blob, at most Workers at once across publications.
func (p *Publisher) uploadAll(ctx context.Context, j *job, ds []repository.Digest, files map[repository.Digest]LayerFile) error {
	g, gctx := errgroup.WithContext(ctx)
	for _, d := range ds {
		g.Go(func() error {
			select {
			case p.sem <- struct{}{}:
			case <-gctx.Done():
				return gctx.Err()
			}
			defer func() { <-p.sem }()
			err := p.retry(gctx, "upload "+string(d), func() error { return p.upload(gctx, d, files[d]) })
			if err == nil {
				j.update(func(s *Status) { s.Uploaded++ })
			}
			return err
		})
	}
	return g.Wait()
}

// upload puts one blob: from the node cache when it holds it, otherwise
// from the layer file.
func (p *Publisher) upload(ctx context.Context, d repository.Digest, l LayerFile) error {
	if p.local != nil && p.cached(d) {
		_, err := p.local.Publish(ctx, d)
		if err == nil || !errors.Is(err, repository.ErrNotFound) {
			return err
		}
		// Evicted meanwhile (it was pinned, so only by a restart's
		// verification dropping a corrupt copy): fall back to the file.
	}
	f, err := os.Open(l.Path)
	if err != nil {
		return fmt.Errorf("snapshot: layer %s: %w", l.Path, err)
	}
	defer f.Close()
	st, err := f.Stat()
	if err != nil {
		return fmt.Errorf("snapshot: %w", err)
	}
	_, err = p.repo.PutBlob(ctx, d, st.Size(), f)
	return err
}

// missing returns the digests the repository lacks.
func (p *Publisher) missing(ctx context.Context, ds []repository.Digest) ([]repository.Digest, error) {
	var out []repository.Digest
	for _, d := range ds {
		err := p.retry(ctx, "stat "+string(d), func() error {
			_, err := p.repo.StatBlob(ctx, d)
			return err
		})
		if errors.Is(err, repository.ErrNotFound) {
			out = append(out, d)
		} else if err != nil {
			return nil, err
		}
	}
	return out, nil
}

// isTransient reports errors worth retrying: anything but bad input,
// missing files, digest mismatches, conflicts and cancellation.
func isTransient(err error) bool {
	for _, e := range []error{repository.ErrInvalid, repository.ErrDigestMismatch, repository.ErrExists,
		repository.ErrConflict, repository.ErrNotFound, ErrInvalid, ErrDeleted, fs.ErrNotExist,
		context.Canceled, context.DeadlineExceeded} {
		if errors.Is(err, e) {
			return false
		}
	}
	return true
}

// retry calls fn until it succeeds, fails permanently, runs out of
// attempts or ctx ends, backing off exponentially between attempts.
func (p *Publisher) retry(ctx context.Context, what string, fn func() error) error {
	wait := p.o.RetryBase
	for attempt := 1; ; attempt++ {
		err := fn()
		if err == nil || !isTransient(err) || attempt >= p.o.MaxAttempts {
			if err != nil && attempt > 1 {
				err = fmt.Errorf("%s (after %d attempts): %w", what, attempt, err)
			}
			return err
		}
		p.log.Warn("snapshot: repository call failed; retrying", "op", what, "attempt", attempt, "in", wait, "err", err)
		t := time.NewTimer(wait)
		select {
		case <-t.C:
		case <-ctx.Done():
			t.Stop()
			return fmt.Errorf("%s: %w (last error: %v)", what, ctx.Err(), err)
		}
		wait = min(wait*2, 30*time.Second)
	}
}
