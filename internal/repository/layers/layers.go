// Package layers opens a stack's sealed lowers from a repository: each layer
// is read lazily, in ranges, through the storage block cache, so a sandbox
// starts from a snapshot in any repository (posix_fs, s3, the node cache in
// front of either) without downloading its layers first.
package layers

import (
	"context"
	"fmt"

	"github.com/aenv-dev/aenv/internal/repository"
	"github.com/aenv-dev/aenv/internal/storage/cache"
	"github.com/aenv-dev/aenv/internal/storage/stack"
)

// Resolver implements stack.Resolver over a repository.
type Resolver struct {
	Repo repository.Repository
	// Cache, when set, keeps the blocks read (by digest, so layers shared by
	// snapshots share cached blocks); nil reads through to the repository.
	Cache *cache.Cache
}

var _ stack.Resolver = (*Resolver)(nil)

// A repository blob is a block cache source as it is.
var _ cache.Source = repository.BlobReader(nil)

// OpenLayer implements stack.Resolver.
func (r *Resolver) OpenLayer(ctx context.Context, ref stack.LayerRef) (stack.Source, error) {
	d, err := repository.ParseDigest(ref.Digest)
	if err != nil {
		return nil, fmt.Errorf("layers: %w", err)
	}
	br, err := r.Repo.OpenBlob(ctx, d)
	if err != nil {
		return nil, fmt.Errorf("layers: open %s: %w", d, err)
	}
	if ref.Size > 0 && br.Size() != ref.Size {
		br.Close()
		return nil, fmt.Errorf("%w: layer %s is %d bytes, manifest says %d", repository.ErrDigestMismatch, d, br.Size(), ref.Size)
	}
	if r.Cache == nil {
		return &direct{br}, nil
	}
	return &cached{File: r.Cache.File(string(d), br), blob: br}, nil
}

type cached struct {
	*cache.File
	blob repository.BlobReader
}

func (c *cached) Close() error { return c.blob.Close() }

// direct adapts a BlobReader to io.ReaderAt; stacks read without a context.
type direct struct{ repository.BlobReader }

func (d *direct) ReadAt(p []byte, off int64) (int, error) {
	return d.BlobReader.ReadAt(context.Background(), p, off)
}
