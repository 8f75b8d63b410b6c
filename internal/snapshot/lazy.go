package snapshot

import (
	"context"
	"encoding/json"
	"fmt"
	"os"

	"github.com/aenv-dev/aenv/internal/repository"
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
