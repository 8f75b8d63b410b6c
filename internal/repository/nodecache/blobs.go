package nodecache

import (
	"context"
	"fmt"
	"io"
	"os"
	"time"

	"github.com/aenv-dev/aenv/internal/repository"
)

// acquire opens the local copy of d, verifying it first when it was loaded
// from disk and not yet checked; the entry counts as open (not evictable)
// until release. ok is false on a miss.
func (c *Cache) acquire(d repository.Digest) (f *os.File, size int64, ok bool, err error) {
	for {
		c.mu.Lock()
		e := c.entries[d]
		if e == nil {
			c.mu.Unlock()
			return nil, 0, false, nil
		}
		if e.verified {
			e.open++
			c.touchLocked(d, e)
			c.mu.Unlock()
			break
		}
		c.mu.Unlock()
		if _, err, _ := c.flight.Do("verify:"+string(d), func() (any, error) { return nil, c.verify(d) }); err != nil {
			return nil, 0, false, err
		}
	}
	f, err = os.Open(c.blobPath(d))
	if err != nil {
		c.mu.Lock()
		c.entries[d].open--
		c.dropLocked(d)
		c.mu.Unlock()
		c.log.Warn("nodecache: cached blob vanished", "digest", d, "err", err)
		return nil, 0, false, nil
	}
	c.mu.Lock()
	size = c.entries[d].size
	c.mu.Unlock()
	return f, size, true, nil
}

func (c *Cache) release(d repository.Digest) {
	c.mu.Lock()
	if e := c.entries[d]; e != nil {
		e.open--
	}
	c.mu.Unlock()
}

// verify re-hashes one cached file; a corrupt one is dropped (and will be
// fetched again), which is not an error.
func (c *Cache) verify(d repository.Digest) error {
	f, err := os.Open(c.blobPath(d))
	if err == nil {
		v := repository.NewVerifier(d, -1)
		_, err = io.Copy(v, f)
		f.Close()
		if err == nil {
			err = v.Check()
		}
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	if e := c.entries[d]; e != nil {
		if err == nil {
			e.verified = true
			return nil
		}
		c.corrupt.Add(1)
		c.log.Warn("nodecache: dropping corrupt cached blob", "digest", d, "err", err)
		c.dropLocked(d)
	}
	return nil
}

// Verify re-hashes every cached blob not verified since Open, dropping
// corrupt ones.
func (c *Cache) Verify(ctx context.Context) error {
	c.mu.Lock()
	var todo []repository.Digest
	for d, e := range c.entries {
		if !e.verified {
			todo = append(todo, d)
		}
	}
	c.mu.Unlock()
	for _, d := range todo {
		if err := ctx.Err(); err != nil {
			return err
		}
		if _, err, _ := c.flight.Do("verify:"+string(d), func() (any, error) { return nil, c.verify(d) }); err != nil {
			return err
		}
	}
	return nil
}

// Fetch makes d local, copying it from the remote once however many callers
// ask at the same time. A caller whose ctx ends stops waiting; the copy
// goes on for the others.
func (c *Cache) Fetch(ctx context.Context, d repository.Digest) error {
	if err := d.Validate(); err != nil {
		return err
	}
	if f, _, ok, err := c.acquire(d); err != nil || ok {
		if ok {
			f.Close()
			c.release(d)
		}
		return err
	}
	ch := c.flight.DoChan("fetch:"+string(d), func() (any, error) {
		return nil, c.fetch(context.WithoutCancel(ctx), d)
	})
	select {
	case <-ctx.Done():
		return ctx.Err()
	case res := <-ch:
		return res.Err
	}
}

func (c *Cache) fetch(ctx context.Context, d repository.Digest) error {
	if c.Cached(d) {
		return nil
	}
	info, err := c.remote.StatBlob(ctx, d)
	if err != nil {
		return err
	}
	if err := c.reserve(d, info.Size); err != nil {
		return err
	}
	rc, err := c.remote.GetBlob(ctx, d)
	if err != nil {
		c.unreserve(info.Size)
		return err
	}
	defer rc.Close()
	tmp, n, err := c.writeTmp(d, info.Size, rc)
	if err != nil {
		c.unreserve(info.Size)
		return err
	}
	c.fetches.Add(1)
	c.fetched.Add(n)
	c.insert(d, tmp, n, info.Size)
	return nil
}

// writeTmp copies r into a file under tmp/, verifying the digest.
func (c *Cache) writeTmp(d repository.Digest, size int64, r io.Reader) (string, int64, error) {
	f, err := os.CreateTemp(c.path("tmp"), "blob-*")
	if err != nil {
		return "", 0, fmt.Errorf("nodecache: %w", err)
	}
	v := repository.NewVerifier(d, size)
	_, err = io.Copy(io.MultiWriter(f, v), r)
	if err == nil {
		err = v.Check()
	}
	if cerr := f.Close(); err == nil {
		err = cerr
	}
	if err != nil {
		os.Remove(f.Name())
		return "", 0, fmt.Errorf("nodecache: %s: %w", d, err)
	}
	return f.Name(), v.N(), nil
}

// insert moves a verified temp file into place; reserved bytes (already
// counted in used) become the entry's.
func (c *Cache) insert(d repository.Digest, tmp string, n, reserved int64) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.used += n - reserved
	if c.entries[d] != nil {
		c.used -= n
		os.Remove(tmp)
		return
	}
	if err := os.Rename(tmp, c.blobPath(d)); err != nil {
		c.used -= n
		os.Remove(tmp)
		c.log.Warn("nodecache: insert", "digest", d, "err", err)
		return
	}
	now := time.Now()
	c.entries[d] = &entry{size: n, access: now, stamped: now, verified: true}
}

// PutLocal stores a blob in the cache only (verified like PutBlob); Publish
// uploads it later. Pin it first if it must survive until then.
func (c *Cache) PutLocal(ctx context.Context, d repository.Digest, size int64, r io.Reader) (repository.BlobInfo, error) {
	if err := d.Validate(); err != nil {
		return repository.BlobInfo{}, err
	}
	if r == nil {
		return repository.BlobInfo{}, fmt.Errorf("%w: nil reader for %s", repository.ErrInvalid, d)
	}
	tmp, err := c.putLocal(ctx, d, size, r)
	if tmp != "" {
		os.Remove(tmp)
	}
	if err != nil {
		return repository.BlobInfo{}, err
	}
	return repository.BlobInfo{Digest: d, Size: c.localSize(d), LastUsed: time.Now()}, nil
}

// putLocal returns the temp file still holding the bytes when they could
// not be cached for lack of room (PutBlob uploads from it).
func (c *Cache) putLocal(ctx context.Context, d repository.Digest, size int64, r io.Reader) (string, error) {
	c.mu.Lock()
	if e := c.entries[d]; e != nil {
		defer c.mu.Unlock()
		if size >= 0 && e.size != size {
			return "", fmt.Errorf("%w: %s is cached with %d bytes, declared %d", repository.ErrDigestMismatch, d, e.size, size)
		}
		c.touchLocked(d, e)
		return "", nil
	}
	c.mu.Unlock()
	tmp, n, err := c.writeTmp(d, size, ctxReader{ctx, r})
	if err != nil {
		return "", err
	}
	if err := c.reserve(d, n); err != nil {
		return tmp, err
	}
	c.insert(d, tmp, n, n)
	return "", nil
}

func (c *Cache) localSize(d repository.Digest) int64 {
	c.mu.Lock()
	defer c.mu.Unlock()
	if e := c.entries[d]; e != nil {
		return e.size
	}
	return 0
}

// Publish uploads a cached blob to the remote; the copy is not evictable
// while it is read.
func (c *Cache) Publish(ctx context.Context, d repository.Digest) (repository.BlobInfo, error) {
	f, size, ok, err := c.acquire(d)
	if err != nil {
		return repository.BlobInfo{}, err
	}
	if !ok {
		return repository.BlobInfo{}, fmt.Errorf("%w: %s is not cached on this node", repository.ErrNotFound, d)
	}
	defer c.release(d)
	defer f.Close()
	info, err := c.remote.PutBlob(ctx, d, size, f)
	if err == nil {
		c.published.Add(1)
	}
	return info, err
}
