package snapshot

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"os"

	"github.com/aenv-dev/aenv/internal/repository"
	"github.com/aenv-dev/aenv/internal/repository/layers"
	"github.com/aenv-dev/aenv/internal/storage/stack"
)

// MergeCount is the compaction policy: how many of the newest layers of a
// stack depth layers deep to merge into one so that it is maxDepth deep
// again; 0 when it is not deeper than maxDepth. The newest layers are the
// ones merged because they are the snapshot's own (small, recent deltas);
// the bottom ones are usually a template's, shared by many stacks.
func MergeCount(depth, maxDepth int) int {
	if maxDepth < 1 || depth <= maxDepth {
		return 0
	}
	return depth - maxDepth + 1
}

// rootRole is the role of a stack's layers in a record.
const rootRole = "rootfs"

// Compact merges the newest layers of record id's stack when it is deeper
// than MaxDepth, publishes the merged layer and a new revision of the record
// naming it, and points this node's catalog entry at it. The old layers
// stay in the repository until GC finds nothing references them (sandboxes
// running on them keep working). It reports whether it merged; a record
// changed concurrently (revision conflict) is left alone.
func (p *Publisher) Compact(ctx context.Context, id string) (bool, error) {
	p.syncMu.Lock() // not while a sync or delete changes the same entries
	defer p.syncMu.Unlock()
	rec, err := p.record(ctx, id)
	if err != nil {
		return false, err
	}
	if rec.State != repository.StateComplete {
		return false, nil
	}
	var root []repository.Layer
	for _, l := range rec.Layers {
		if l.Role == rootRole {
			root = append(root, l)
		}
	}
	n := MergeCount(len(root), p.o.MaxDepth)
	if n == 0 {
		return false, nil
	}
	var cfg recordConfig
	if len(rec.Config) > 0 {
		if err := json.Unmarshal(rec.Config, &cfg); err != nil {
			return false, fmt.Errorf("%w: record %s config: %v", ErrInvalid, id, err)
		}
	}
	local := p.localPaths(cfg.Artifact)

	merged, err := p.merge(ctx, root, local, n)
	if err != nil {
		return false, err
	}
	if err := p.retry(ctx, "upload merged layer of "+id, func() error {
		f, err := os.Open(merged.Path)
		if err != nil {
			return err
		}
		defer f.Close()
		_, err = p.repo.PutBlob(ctx, merged.Digest, merged.Size, f)
		return err
	}); err != nil {
		return false, err
	}

	// The merged layer is read lazily elsewhere like any other: publish its
	// block hash list (new, so GC's grace keeps it until the record names it).
	mergedLayer := repository.Layer{Role: rootRole, Digest: merged.Digest, Size: merged.Size, UUID: merged.UUID}
	if mergedLayer.BlockHashes, err = p.blockHashes(ctx, merged.Digest, LayerFile{Path: merged.Path}); err != nil {
		return false, err
	}
	if err := p.putBlockHashes(ctx, []repository.Layer{mergedLayer}); err != nil {
		return false, err
	}
	keep := root[:len(root)-n]
	newRoot := append(append([]repository.Layer(nil), keep...), mergedLayer)
	refs := make([]layerRef, 0, len(newRoot))
	for _, l := range newRoot {
		path := local[l.Digest]
		if path == "" {
			path = p.layerPath(l.Digest)
		}
		if l.Digest == merged.Digest {
			path = merged.Path
		}
		refs = append(refs, layerRef{Path: path, Digest: l.Digest, Size: l.Size, UUID: l.UUID})
	}
	oldRoot := make([]repository.Digest, len(root))
	for i, l := range root {
		oldRoot[i] = l.Digest
	}
	art, _, err := withLayerList(cfg.Artifact, oldRoot, refs)
	if err != nil {
		return false, err
	}
	cfg.Artifact = art
	rawCfg, err := json.Marshal(cfg)
	if err != nil {
		return false, err
	}
	next := rec
	next.Config = rawCfg
	next.Layers = newRoot
	for _, l := range rec.Layers {
		if l.Role != rootRole {
			next.Layers = append(next.Layers, l)
		}
	}
	stored, err := p.repo.PutRecord(ctx, next)
	if errors.Is(err, repository.ErrConflict) || errors.Is(err, repository.ErrNotFound) {
		p.log.Info("snapshot: record changed during compaction; leaving it", "id", id)
		return false, nil
	}
	if err != nil {
		return false, fmt.Errorf("snapshot: compact %s: %w", id, err)
	}
	t, _ := p.tracked(id)
	t.ID, t.Kind, t.Revision, t.Digests = id, rec.Kind, stored.Revision, stored.Digests()
	if err := p.track(t); err != nil {
		return true, err
	}
	if cur, err := p.cat.Get(id); err == nil {
		byPath := map[string]repository.Digest{}
		for d, path := range local {
			byPath[path] = d
		}
		a, err := withDigests(cur.Artifact, byPath)
		if err == nil {
			a, _, err = withLayerList(a, oldRoot, refs)
		}
		if err == nil {
			cur.Artifact = a
			err = p.cat.Put(cur)
		}
		if err != nil {
			return true, fmt.Errorf("snapshot: compact %s: update catalog: %w", id, err)
		}
	}
	p.log.Info("snapshot: merged stack", "id", id, "merged_layers", n, "depth", len(newRoot), "digest", merged.Digest)
	return true, nil
}

// CompactAll compacts every record this node published.
func (p *Publisher) CompactAll(ctx context.Context) error {
	known, err := p.trackedAll()
	if err != nil {
		return err
	}
	var errs []error
	for id, t := range known {
		if !t.Local || p.journaled(id) || len(t.Digests) <= p.o.MaxDepth {
			continue
		}
		if _, err := p.Compact(ctx, id); err != nil {
			errs = append(errs, err)
		}
	}
	return errors.Join(errs...)
}

func (p *Publisher) record(ctx context.Context, id string) (repository.Record, error) {
	for _, k := range repository.Kinds() {
		rec, err := p.repo.GetRecord(ctx, k, id)
		if errors.Is(err, repository.ErrNotFound) {
			continue
		}
		return rec, err
	}
	return repository.Record{}, fmt.Errorf("%w: %s", ErrNotFound, id)
}

// localPaths maps the digests an artifact names to files on this node that
// exist: the artifact's own paths (on the node that made it) or layers
// fetched here.
func (p *Publisher) localPaths(art json.RawMessage) map[repository.Digest]string {
	out := map[repository.Digest]string{}
	v, err := decodeJSON(art)
	if len(art) == 0 || err != nil {
		return out
	}
	walkLayerRefs(v, func(o map[string]any) {
		d, _ := o["digest"].(string)
		path, _ := o["path"].(string)
		if d == "" || path == "" {
			return
		}
		if _, err := os.Stat(path); err == nil {
			out[repository.Digest(d)] = path
		}
	})
	return out
}

// merge writes the merge of the n newest layers of root into this node's
// layer store and returns it with its digest.
func (p *Publisher) merge(ctx context.Context, root []repository.Layer, local map[repository.Digest]string, n int) (layerRef, error) {
	m := &stack.Manifest{}
	for _, l := range root {
		ref := stack.LayerRef{Digest: string(l.Digest), Size: l.Size, UUID: l.UUID}
		if path := local[l.Digest]; path != "" {
			ref.Path = path
		} else if _, err := os.Stat(p.layerPath(l.Digest)); err == nil {
			ref.Path = p.layerPath(l.Digest)
		}
		m.Lowers = append(m.Lowers, ref)
	}
	s, err := stack.Open(ctx, m, stack.Options{Resolver: &layers.Resolver{Repo: p.repo}})
	if err != nil {
		return layerRef{}, fmt.Errorf("snapshot: open stack to merge: %w", err)
	}
	var rnd [6]byte
	_, _ = rand.Read(rnd[:])
	tmp := p.path("layers", ".merge-"+hex.EncodeToString(rnd[:]))
	ref, err := s.Compact(ctx, tmp, n)
	if cerr := s.Close(); err == nil && cerr != nil {
		err = cerr
	}
	if err != nil {
		os.Remove(tmp)
		return layerRef{}, fmt.Errorf("snapshot: merge: %w", err)
	}
	d, size, err := hashFile(tmp)
	if err == nil {
		err = os.Chmod(tmp, 0o444)
	}
	if err == nil {
		err = os.Rename(tmp, p.layerPath(d))
	}
	if err != nil {
		os.Remove(tmp)
		return layerRef{}, fmt.Errorf("snapshot: merge: %w", err)
	}
	return layerRef{Path: p.layerPath(d), Digest: d, Size: size, UUID: ref.UUID}, nil
}
