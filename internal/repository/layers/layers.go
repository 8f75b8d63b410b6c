// Package layers opens a stack's sealed lowers from a repository: each layer
// is read lazily, in ranges, through the storage block cache, so a sandbox
// starts from a snapshot in any repository (posix_fs, s3, the node cache in
// front of either) without downloading its layers first.
//
// A node that reads a layer lazily holds no copy of it: the repository's
// blob is the only one. Records keep blobs from GC, but a record deleted on
// another node would let that node's GC take a blob a sandbox here still
// reads; KeepAlive refreshes such blobs' LastUsed so every node's GC spares
// them for its grace period.
package layers

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"maps"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	"github.com/aenv-dev/aenv/internal/repository"
	"github.com/aenv-dev/aenv/internal/storage/cache"
	"github.com/aenv-dev/aenv/internal/storage/stack"
)

// Resolver implements stack.Resolver over a repository. Its zero value but
// Repo is ready to use; it must not be copied after first use.
type Resolver struct {
	Repo repository.Repository
	// Cache, when set, keeps the blocks read (by digest, so layers shared by
	// snapshots share cached blocks); nil reads through to the repository.
	// Blobs Repo holds on this node (a node cache's Cached) bypass it: they
	// are local files already.
	Cache *cache.Cache
	// Remote is the repository behind Repo's node cache (Repo itself when it
	// has none); KeepAlive refreshes blobs there. Nil disables KeepAlive.
	Remote repository.Repository
	// Hashes, when set, names the block hash lists of remote layers: every
	// range fetched from such a layer is verified before it is cached or
	// read (a mismatch is an error wrapping cache.ErrVerify). Layers it
	// knows no list for are read unverified, with one warning per layer.
	Hashes HashIndex
	// Peers, when set, reads verified remote layers from other nodes first
	// (peer-to-peer distribution in a cluster); nil reads them from Repo only.
	Peers PeerSource

	fetched    atomic.Int64 // bytes read from remote blobs
	badDirect  atomic.Int64 // verification failures of uncached reads
	unverified sync.Map     // digests warned about once

	leases sync.WaitGroup // keep-alives started by OpenLayer
	mu     sync.Mutex
	open   map[repository.Digest]int // remote blobs open now
}

var _ stack.Resolver = (*Resolver)(nil)

// A repository blob is a block cache source as it is.
var _ cache.Source = repository.BlobReader(nil)

// PeerSource wraps a remote layer's reader so that its chunks come from peers,
// each checked against sums, and from repo only what no peer serves correctly
// (p2p.Fetcher). The wrapper's Close closes repo.
type PeerSource interface {
	Wrap(d repository.Digest, repo repository.BlobReader, sums *cache.Sums) repository.BlobReader
}

// listNamer is a HashIndex that knows the digest each layer's block hash
// list is published under (HashStore): a reader keeps the list alive with its
// layer, or GC would take the list from under the layer, and a node that
// syncs the layer's record later could not register it.
type listNamer interface {
	ListDigest(layer repository.Digest) (repository.Digest, bool)
}

// localCache is what a node cache (*nodecache.Cache) tells about its blobs.
type localCache interface {
	Cached(repository.Digest) bool
}

// OpenLayer implements stack.Resolver.
func (r *Resolver) OpenLayer(ctx context.Context, ref stack.LayerRef) (stack.Source, error) {
	d, err := repository.ParseDigest(ref.Digest)
	if err != nil {
		return nil, fmt.Errorf("layers: %w", err)
	}
	// Checked before the open: a blob fetched whole meanwhile is then read
	// through the block cache once, which is only slower.
	lc, ok := r.Repo.(localCache)
	local := ok && lc.Cached(d)
	br, err := r.Repo.OpenBlob(ctx, d)
	if err != nil {
		return nil, fmt.Errorf("layers: open %s: %w", d, err)
	}
	if ref.Size > 0 && br.Size() != ref.Size {
		br.Close()
		return nil, fmt.Errorf("%w: layer %s is %d bytes, manifest says %d", repository.ErrDigestMismatch, d, br.Size(), ref.Size)
	}
	if local {
		return &direct{br}, nil
	}
	rb := &remoteBlob{BlobReader: br, r: r, d: d}
	r.mu.Lock()
	if r.open == nil {
		r.open = map[repository.Digest]int{}
	}
	r.open[d]++
	first := r.open[d] == 1
	r.mu.Unlock()
	if first && r.Remote != nil {
		// Until the next KeepAlive, only the record keeps the blob; a delete
		// of the record elsewhere must not take it from under this reader.
		r.leases.Go(func() {
			lctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), time.Minute)
			defer cancel()
			if err := r.touch(lctx, d); err != nil {
				slog.Warn("layers: keep a lazily read layer alive", "digest", d, "err", err)
			}
		})
	}
	sums, err := r.sums(ctx, d, br.Size())
	if err != nil {
		rb.Close()
		return nil, err
	}
	// Only verified layers are read from peers: a peer's bytes are trusted no more
	// than the repository's.
	var src repository.BlobReader = rb
	if sums != nil && r.Peers != nil {
		src = r.Peers.Wrap(d, rb, sums)
	}
	switch {
	case r.Cache == nil && sums == nil:
		return &direct{rb}, nil
	case r.Cache == nil:
		return &verifiedDirect{blob: src, d: d, sums: sums, failures: &r.badDirect}, nil
	case sums == nil:
		return &cached{File: r.Cache.File(string(d), rb), blob: rb}, nil
	}
	f, err := r.Cache.FileVerified(string(d), src, sums)
	if err != nil {
		rb.Close()
		return nil, fmt.Errorf("layers: %s: %w", d, err)
	}
	return &cached{File: f, blob: rb}, nil
}

// sums returns the block sums to verify remote layer d against, or nil when
// its record published none.
func (r *Resolver) sums(ctx context.Context, d repository.Digest, size int64) (*cache.Sums, error) {
	if r.Hashes == nil {
		return nil, nil
	}
	h, err := r.Hashes.BlockHashes(ctx, d)
	if err != nil {
		return nil, err
	}
	if h == nil {
		if _, warned := r.unverified.LoadOrStore(d, true); !warned {
			slog.Warn("layers: no block hash list published for this layer (published before lists existed); its lazily read blocks are not verified",
				"digest", d)
		}
		return nil, nil
	}
	return sumsFor(d, size, h)
}

// VerifyFailures counts ranges read lazily that did not match their
// layer's block hash list, through the block cache or not.
func (r *Resolver) VerifyFailures() int64 {
	n := r.badDirect.Load()
	if r.Cache != nil {
		n += r.Cache.Stats().VerifyFailures
	}
	return n
}

// Wait waits for the keep-alives OpenLayer started in the background.
func (r *Resolver) Wait() { r.leases.Wait() }

// FetchedBytes is how many bytes were read from blobs not held on this node
// (through the block cache, only its misses and prefetches).
func (r *Resolver) FetchedBytes() int64 { return r.fetched.Load() }

// Open lists the remote blobs open now (lowers of running sandboxes).
func (r *Resolver) Open() []repository.Digest {
	r.mu.Lock()
	defer r.mu.Unlock()
	return slices.Sorted(maps.Keys(r.open))
}

// ErrNoRemote: KeepAlive without a Remote.
var ErrNoRemote = errors.New("layers: no remote repository to keep blobs alive in")

// KeepAlive refreshes, in Remote, the LastUsed of every blob open through r
// and of extra (e.g. the node cache's pins, which cover paused sandboxes),
// except those this node holds a copy of. It returns how many it refreshed;
// blobs that are gone are reported in the error (their readers will fail).
func (r *Resolver) KeepAlive(ctx context.Context, extra []repository.Digest) (int, error) {
	if r.Remote == nil {
		return 0, ErrNoRemote
	}
	ds := append(r.Open(), extra...)
	slices.Sort(ds)
	ds = slices.Compact(ds)
	lc, _ := r.Repo.(localCache)
	n := 0
	var errs []error
	for _, d := range ds {
		if lc != nil && lc.Cached(d) {
			continue
		}
		if err := r.touch(ctx, d); err != nil {
			if ctx.Err() != nil {
				return n, ctx.Err()
			}
			errs = append(errs, fmt.Errorf("layers: keep %s alive: %w", d, err))
			continue
		}
		n++
	}
	return n, errors.Join(errs...)
}

// touch refreshes the LastUsed in Remote of layer d and of its block hash
// list: a present blob is not read again, only touched; a missing one fails
// verification of the empty reader, so nothing is stored.
func (r *Resolver) touch(ctx context.Context, d repository.Digest) error {
	if _, err := r.Remote.PutBlob(ctx, d, -1, eofReader{}); err != nil {
		return err
	}
	if ln, ok := r.Hashes.(listNamer); ok {
		if l, ok := ln.ListDigest(d); ok {
			if _, err := r.Remote.PutBlob(ctx, l, -1, eofReader{}); err != nil {
				return fmt.Errorf("block hash list %s: %w", l, err)
			}
		}
	}
	return nil
}

type eofReader struct{}

func (eofReader) Read([]byte) (int, error) { return 0, io.EOF }

// remoteBlob counts the bytes read from a blob of the remote repository and
// tells the resolver when it is closed.
type remoteBlob struct {
	repository.BlobReader
	r      *Resolver
	d      repository.Digest
	closed atomic.Bool
}

// readTries bounds the attempts of one remote read; a read that still fails
// reaches the sandbox as an I/O error, so a passing network fault must not.
const readTries = 3

func (b *remoteBlob) ReadAt(ctx context.Context, p []byte, off int64) (int, error) {
	wait := 50 * time.Millisecond
	for try := 1; ; try++ {
		n, err := b.BlobReader.ReadAt(ctx, p, off)
		b.r.fetched.Add(int64(n))
		if err == nil || errors.Is(err, io.EOF) || !transient(err) || try == readTries {
			return n, err
		}
		t := time.NewTimer(wait)
		select {
		case <-ctx.Done():
			t.Stop()
			return n, err
		case <-t.C:
		}
		wait *= 2
	}
}

// transient reports read errors worth another try: not a missing or corrupt
// blob, bad arguments or cancellation.
func transient(err error) bool {
	for _, e := range []error{repository.ErrNotFound, repository.ErrInvalid, repository.ErrDigestMismatch,
		context.Canceled, context.DeadlineExceeded} {
		if errors.Is(err, e) {
			return false
		}
	}
	return true
}

func (b *remoteBlob) Close() error {
	if b.closed.Swap(true) {
		return nil
	}
	b.r.mu.Lock()
	if b.r.open[b.d]--; b.r.open[b.d] <= 0 {
		delete(b.r.open, b.d)
	}
	b.r.mu.Unlock()
	return b.BlobReader.Close()
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
