package nodecache

import (
	"context"
	"errors"
	"fmt"
	"io"
	"maps"
	"os"
	"slices"
	"time"

	"github.com/aenv-dev/aenv/internal/repository"
)

// PutBlob implements repository.Repository: the blob is cached (when it
// fits) and uploaded to the remote before PutBlob returns.
func (c *Cache) PutBlob(ctx context.Context, d repository.Digest, size int64, r io.Reader) (repository.BlobInfo, error) {
	if err := d.Validate(); err != nil {
		return repository.BlobInfo{}, err
	}
	if r == nil {
		return repository.BlobInfo{}, fmt.Errorf("%w: nil reader for %s", repository.ErrInvalid, d)
	}
	tmp, err := c.putLocal(ctx, d, size, r)
	if errors.Is(err, ErrCacheFull) && tmp != "" {
		// No room here: the verified bytes still go to the remote.
		defer os.Remove(tmp)
		f, oerr := os.Open(tmp)
		if oerr != nil {
			return repository.BlobInfo{}, fmt.Errorf("nodecache: %w", oerr)
		}
		defer f.Close()
		st, _ := f.Stat()
		return c.remote.PutBlob(ctx, d, st.Size(), f)
	}
	if err != nil {
		return repository.BlobInfo{}, err
	}
	return c.Publish(ctx, d)
}

// GetBlob implements repository.Repository, fetching a missing blob into the
// cache first (or streaming it from the remote when it cannot fit).
func (c *Cache) GetBlob(ctx context.Context, d repository.Digest) (io.ReadCloser, error) {
	if err := d.Validate(); err != nil {
		return nil, err
	}
	for try := 0; ; try++ {
		f, size, ok, err := c.acquire(d)
		if err != nil {
			return nil, err
		}
		if ok {
			c.hits.Add(1)
			// Verified when cached; checked again as it streams, as the
			// interface promises, to catch corruption since then.
			return repository.VerifyingReadCloser(&localFile{File: f, release: func() { c.release(d) }}, d, size), nil
		}
		if try > 0 {
			break // evicted between the fetch and now: read remotely
		}
		c.misses.Add(1)
		if err := c.Fetch(ctx, d); errors.Is(err, ErrCacheFull) {
			break
		} else if err != nil {
			return nil, err
		}
	}
	c.remoteReads.Add(1)
	return c.remote.GetBlob(ctx, d)
}

// OpenBlob implements repository.Repository: a cached blob is read locally;
// a missing one is fetched first with FetchOnOpen, or else read lazily in
// ranges from the remote.
func (c *Cache) OpenBlob(ctx context.Context, d repository.Digest) (repository.BlobReader, error) {
	if err := d.Validate(); err != nil {
		return nil, err
	}
	for try := 0; ; try++ {
		f, size, ok, err := c.acquire(d)
		if err != nil {
			return nil, err
		}
		if ok {
			c.hits.Add(1)
			return &localReader{f: &localFile{File: f, release: func() { c.release(d) }}, size: size}, nil
		}
		if try > 0 || !c.o.FetchOnOpen {
			break
		}
		c.misses.Add(1)
		if err := c.Fetch(ctx, d); errors.Is(err, ErrCacheFull) {
			break
		} else if err != nil {
			return nil, err
		}
	}
	c.remoteReads.Add(1)
	return c.remote.OpenBlob(ctx, d)
}

// StatBlob implements repository.Repository; the remote is authoritative.
func (c *Cache) StatBlob(ctx context.Context, d repository.Digest) (repository.BlobInfo, error) {
	return c.remote.StatBlob(ctx, d)
}

// DeleteBlob implements repository.Repository: gone here and remotely.
func (c *Cache) DeleteBlob(ctx context.Context, d repository.Digest) error {
	if err := d.Validate(); err != nil {
		return err
	}
	c.Drop(d)
	return c.remote.DeleteBlob(ctx, d)
}

// Drop removes the local copy of d only (a reader holding it open keeps
// reading the unlinked file).
func (c *Cache) Drop(d repository.Digest) {
	c.mu.Lock()
	c.dropLocked(d)
	c.mu.Unlock()
}

// DeleteBlobIfUnused implements repository.Repository on the remote; the
// local copy stays (its bytes are still right) until evicted.
func (c *Cache) DeleteBlobIfUnused(ctx context.Context, d repository.Digest, cutoff time.Time) error {
	return c.remote.DeleteBlobIfUnused(ctx, d, cutoff)
}

// WalkBlobs implements repository.Repository on the remote.
func (c *Cache) WalkBlobs(ctx context.Context, fn func(repository.BlobInfo) error) error {
	return c.remote.WalkBlobs(ctx, fn)
}

// PutRecord implements repository.Repository on the remote.
func (c *Cache) PutRecord(ctx context.Context, rec repository.Record) (repository.Record, error) {
	return c.remote.PutRecord(ctx, rec)
}

// GetRecord implements repository.Repository on the remote.
func (c *Cache) GetRecord(ctx context.Context, kind repository.Kind, id string) (repository.Record, error) {
	return c.remote.GetRecord(ctx, kind, id)
}

// ListRecords implements repository.Repository on the remote.
func (c *Cache) ListRecords(ctx context.Context, kind repository.Kind, o repository.ListOptions) (repository.Page, error) {
	return c.remote.ListRecords(ctx, kind, o)
}

// DeleteRecord implements repository.Repository on the remote.
func (c *Cache) DeleteRecord(ctx context.Context, kind repository.Kind, id string) error {
	return c.remote.DeleteRecord(ctx, kind, id)
}

// localFile releases the cache entry once, on Close.
type localFile struct {
	*os.File
	release func()
	closed  bool
}

func (f *localFile) Close() error {
	if f.closed {
		return nil
	}
	f.closed = true
	f.release()
	return f.File.Close()
}

type localReader struct {
	f    *localFile
	size int64
}

func (r *localReader) ReadAt(ctx context.Context, p []byte, off int64) (int, error) {
	if off < 0 {
		return 0, fmt.Errorf("%w: negative offset %d", repository.ErrInvalid, off)
	}
	return r.f.ReadAt(p, off)
}

func (r *localReader) Size() int64  { return r.size }
func (r *localReader) Close() error { return r.f.Close() }

type ctxReader struct {
	ctx context.Context
	r   io.Reader
}

func (c ctxReader) Read(p []byte) (int, error) {
	if err := c.ctx.Err(); err != nil {
		return 0, err
	}
	return c.r.Read(p)
}

// AbortStaleUploads passes repository.UploadReclaimer through to the remote
// (the node cache's own writes are local files, renamed into place).
func (c *Cache) AbortStaleUploads(ctx context.Context) (int, error) {
	if ur, ok := c.remote.(repository.UploadReclaimer); ok {
		return ur.AbortStaleUploads(ctx)
	}
	return 0, nil
}

// OpenLocal opens d only if this node holds it whole (ok false otherwise): what the node
// serves to its peers, which must never make it fetch from the remote.
func (c *Cache) OpenLocal(d repository.Digest) (repository.BlobReader, bool, error) {
	if err := d.Validate(); err != nil {
		return nil, false, err
	}
	f, size, ok, err := c.acquire(d)
	if err != nil || !ok {
		return nil, false, err
	}
	return &localReader{f: &localFile{File: f, release: func() { c.release(d) }}, size: size}, true, nil
}

// Local lists the blobs this node holds whole, sorted.
func (c *Cache) Local() []repository.Digest {
	c.mu.Lock()
	out := slices.Collect(maps.Keys(c.entries))
	c.mu.Unlock()
	slices.Sort(out)
	return out
}
