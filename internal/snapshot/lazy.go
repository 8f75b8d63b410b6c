package snapshot

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"slices"

	"github.com/aenv-dev/aenv/internal/repository"
	"github.com/aenv-dev/aenv/internal/repository/layers"
)

// Lazy layers (Options.LazyLayers): Sync registers a record without fetching
// its layers. Every layer ref of the artifact keeps its digest and loses the
// publishing node's path, unless this node has the layer as a file already
// (a merge it made, a fetch of an eager run), so the backend opens it through
// its layer resolver: only the blocks a sandbox reads are fetched, through
// the node's block cache. Snapshots of such sandboxes name those layers by
// digest only (LayerFile.Digest), and their publication references the blobs
// already in the repository instead of uploading them.

// lazyPaths maps each digest of rec's layers to the file this node holds
// with its bytes, or to "" when it holds none (the layer is read lazily).
func (p *Publisher) lazyPaths(rec repository.Record) map[repository.Digest]string {
	out := map[repository.Digest]string{}
	for _, l := range rec.Layers {
		out[l.Digest] = ""
		if path := p.layerPath(l.Digest); fileExists(path) {
			out[l.Digest] = path
		}
	}
	return out
}

func fileExists(path string) bool {
	st, err := os.Stat(path)
	return err == nil && st.Mode().IsRegular()
}

// withLazyPaths points the refs of the layers in local at this node's file,
// or makes them digest-only where local has "": a path another node wrote
// is meaningless here. Objects with other digests (an image's manifest or
// source layers) are left alone.
func withLazyPaths(raw json.RawMessage, local map[repository.Digest]string) (json.RawMessage, error) {
	return rewriteArtifact(raw, func(o map[string]any) {
		d, _ := o["digest"].(string)
		path, ok := local[repository.Digest(d)]
		switch {
		case !ok:
		case path != "":
			o["path"] = path
		default:
			delete(o, "path")
		}
	})
}

// layerDigest is the digest and size of a manifest layer: hashed from its
// file, or, for a digest-only layer, checked to be in the repository (a
// publication may reference it but not upload it: this node has no copy).
func (p *Publisher) layerDigest(ctx context.Context, l LayerFile) (repository.Digest, int64, error) {
	if l.Path != "" {
		return p.dg.digest(l)
	}
	var info repository.BlobInfo
	err := p.retry(ctx, "stat "+string(l.Digest), func() error {
		var err error
		info, err = p.repo.StatBlob(ctx, l.Digest)
		return err
	})
	if err != nil {
		return "", 0, fmt.Errorf("snapshot: layer %s (read lazily, no copy on this node): %w", l.Digest, err)
	}
	if l.Size > 0 && info.Size != l.Size {
		return "", 0, fmt.Errorf("%w: layer %s is %d bytes in the repository, manifest says %d", ErrInvalid, l.Digest, info.Size, l.Size)
	}
	return l.Digest, info.Size, nil
}

// Block hash lists (repository.BlockHashes): a node reading a layer lazily
// can only check the ranges it fetches against per-chunk hashes, so every
// layer is published with its list, a blob of its own that the record's
// layer entry names. The list of a layer this node has as a file is
// computed from the file once (then kept in p.hashes); a layer read lazily
// has the list its record named, learnt when the record was synced; a
// layer published before lists existed has none, and a record naming it
// names none either (its readers log that it is read unverified).

// HashIndex is where the node's layer resolver finds the lists of the
// layers it reads lazily.
func (p *Publisher) HashIndex() layers.HashIndex { return p.hashes }

// blockHashes returns the digest of layer d's list, computing and storing
// the list when this node has the layer's file and no list for it yet.
func (p *Publisher) blockHashes(ctx context.Context, d repository.Digest, l LayerFile) (repository.Digest, error) {
	if b, err := p.hashes.Encoded(d); err == nil {
		if _, err := repository.DecodeBlockHashes(b); err == nil {
			return repository.DigestOf(b), nil
		}
	}
	if l.Path == "" {
		return "", nil // read lazily from a record without a list
	}
	var r io.ReadCloser
	r, err := os.Open(l.Path)
	if errors.Is(err, fs.ErrNotExist) {
		// A resumed publication whose file is gone: the node cache has the
		// bytes (step 1 found them there), verified as they stream.
		r, err = p.repo.GetBlob(ctx, d)
	}
	if err != nil {
		return "", fmt.Errorf("snapshot: layer %s: %w", l.Path, err)
	}
	defer r.Close()
	h, err := repository.ComputeBlockHashes(r, repository.DefaultBlockHashChunk)
	if err != nil {
		return "", fmt.Errorf("snapshot: layer %s: %w", l.Path, err)
	}
	if err := ctx.Err(); err != nil {
		return "", err
	}
	// The list is kept under the digest the layer was hashed to; a file
	// changed since then fails its own upload's digest check.
	return p.hashes.Put(d, h)
}

// putBlockHashes uploads the lists that layers name and the repository
// lacks (new ones, or ones GC took with their last record). It runs once
// the pending record names them, so a list found present stays.
func (p *Publisher) putBlockHashes(ctx context.Context, ls []repository.Layer) error {
	var named []repository.Digest
	for _, l := range ls {
		if l.BlockHashes != "" {
			named = append(named, l.BlockHashes)
		}
	}
	missing, err := p.missing(ctx, named)
	if err != nil {
		return err
	}
	for _, l := range ls {
		if l.BlockHashes == "" || !slices.Contains(missing, l.BlockHashes) {
			continue
		}
		missing = slices.DeleteFunc(missing, func(d repository.Digest) bool { return d == l.BlockHashes })
		b, err := p.hashes.Encoded(l.Digest)
		if err == nil && repository.DigestOf(b) != l.BlockHashes {
			err = fmt.Errorf("%w: stored block hash list of %s changed", repository.ErrDigestMismatch, l.Digest)
		}
		if err != nil {
			return fmt.Errorf("snapshot: block hash list of %s: %w", l.Digest, err)
		}
		err = p.retry(ctx, "upload "+string(l.BlockHashes), func() error {
			_, err := p.repo.PutBlob(ctx, l.BlockHashes, int64(len(b)), bytes.NewReader(b))
			return err
		})
		if err != nil {
			return err
		}
	}
	return nil
}

// blockHashesOf lists the digests of the stored lists of layers ds, so GC
// keeps the lists of pinned layers with them.
func (p *Publisher) blockHashesOf(ds []repository.Digest) []repository.Digest {
	var out []repository.Digest
	for _, d := range ds {
		if b, err := p.hashes.Encoded(d); err == nil {
			out = append(out, repository.DigestOf(b))
		}
	}
	return out
}
