package layers

import (
	"bytes"
	"context"
	"errors"
	"io"
	"os"
	"path/filepath"
	"slices"
	"sync/atomic"
	"testing"
	"time"

	"github.com/aenv-dev/aenv/internal/repository"
	"github.com/aenv-dev/aenv/internal/repository/posixfs"
	"github.com/aenv-dev/aenv/internal/repository/repositorytest"
	"github.com/aenv-dev/aenv/internal/storage/cache"
	"github.com/aenv-dev/aenv/internal/storage/stack"
)

func TestOpenLayer(t *testing.T) {
	repo, err := posixfs.Open(t.TempDir(), posixfs.Options{})
	if err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	data, d := repositorytest.Blob(1, 3<<20+5)
	if _, err := repo.PutBlob(ctx, d, int64(len(data)), bytes.NewReader(data)); err != nil {
		t.Fatal(err)
	}
	bc, err := cache.Open(cache.Options{Dir: t.TempDir(), MaxBytes: 64 << 20})
	if err != nil {
		t.Fatal(err)
	}
	defer bc.Close()
	for name, r := range map[string]*Resolver{"direct": {Repo: repo}, "block cache": {Repo: repo, Cache: bc}} {
		t.Run(name, func(t *testing.T) {
			src, err := r.OpenLayer(ctx, stack.LayerRef{Digest: string(d), Size: int64(len(data))})
			if err != nil {
				t.Fatal(err)
			}
			defer src.Close()
			if src.Size() != int64(len(data)) {
				t.Fatalf("size %d", src.Size())
			}
			for _, off := range []int64{0, 1<<20 - 3, int64(len(data)) - 10} {
				p := make([]byte, 10)
				if n, err := src.ReadAt(p, off); (err != nil && err != io.EOF) || n != 10 || !bytes.Equal(p, data[off:off+10]) {
					t.Fatalf("ReadAt(%d) = %d, %v", off, n, err)
				}
			}
			if _, err := r.OpenLayer(ctx, stack.LayerRef{Digest: string(d), Size: 7}); !errors.Is(err, repository.ErrDigestMismatch) {
				t.Fatalf("size mismatch: %v", err)
			}
			if _, err := r.OpenLayer(ctx, stack.LayerRef{Digest: "sha256:nope"}); !errors.Is(err, repository.ErrInvalid) {
				t.Fatalf("bad digest: %v", err)
			}
			_, missing := repositorytest.Blob(2, 10)
			if _, err := r.OpenLayer(ctx, stack.LayerRef{Digest: string(missing)}); !errors.Is(err, repository.ErrNotFound) {
				t.Fatalf("missing: %v", err)
			}
		})
	}
	if s := bc.Stats(); s.FetchedBytes == 0 {
		t.Fatalf("block cache not used: %+v", s)
	}
}

// A blob read lazily has no copy on this node, so the reader keeps it alive in
// the repository: opening it refreshes its LastUsed (GC spares it for its grace
// period even with no record naming it), KeepAlive refreshes open and extra
// blobs, and a closed blob is left to age. Reads from the repository are counted.
func TestKeepAlive(t *testing.T) {
	dir := t.TempDir()
	repo, err := posixfs.Open(dir, posixfs.Options{})
	if err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	data, d := repositorytest.Blob(3, 1<<20)
	if _, err := repo.PutBlob(ctx, d, int64(len(data)), bytes.NewReader(data)); err != nil {
		t.Fatal(err)
	}
	blobFile := filepath.Join(dir, "blobs", "sha256", d.Hex())
	age := func() {
		old := time.Now().Add(-2 * time.Hour)
		if err := os.Chtimes(blobFile, old, old); err != nil {
			t.Fatal(err)
		}
	}
	fresh := func() bool {
		info, err := repo.StatBlob(ctx, d)
		return err == nil && time.Since(info.LastUsed) < time.Minute
	}
	age()
	r := &Resolver{Repo: repo, Remote: repo}
	src, err := r.OpenLayer(ctx, stack.LayerRef{Digest: string(d)})
	if err != nil {
		t.Fatal(err)
	}
	deadline := time.Now().Add(10 * time.Second)
	for !fresh() {
		if time.Now().After(deadline) {
			t.Fatal("opening a remote blob did not refresh its LastUsed")
		}
		time.Sleep(10 * time.Millisecond)
	}
	r.Wait()
	if got := r.Open(); !slices.Equal(got, []repository.Digest{d}) {
		t.Fatalf("open blobs %v", got)
	}
	p := make([]byte, 8192)
	if _, err := src.ReadAt(p, 4096); err != nil {
		t.Fatal(err)
	}
	if r.FetchedBytes() != 8192 {
		t.Fatalf("fetched %d bytes, want 8192", r.FetchedBytes())
	}
	res, err := repository.GC(ctx, repo, repository.GCOptions{Grace: time.Hour})
	if err != nil || len(res.Deleted) != 0 {
		t.Fatalf("GC took a blob read lazily: %+v %v", res, err)
	}

	age()
	if n, err := r.KeepAlive(ctx, nil); err != nil || n != 1 || !fresh() {
		t.Fatalf("KeepAlive of the open blob: %d, %v, fresh %v", n, err, fresh())
	}
	src.Close()
	src.Close() // idempotent
	if got := r.Open(); len(got) != 0 {
		t.Fatalf("open blobs after close: %v", got)
	}
	age()
	if n, err := r.KeepAlive(ctx, nil); err != nil || n != 0 || fresh() {
		t.Fatalf("KeepAlive refreshed a closed blob: %d, %v", n, err)
	}
	if n, err := r.KeepAlive(ctx, []repository.Digest{d}); err != nil || n != 1 || !fresh() {
		t.Fatalf("KeepAlive of a pinned blob: %d, %v", n, err)
	}
	_, gone := repositorytest.Blob(4, 10)
	if _, err := r.KeepAlive(ctx, []repository.Digest{gone}); err == nil {
		t.Fatal("KeepAlive of a missing blob reported nothing")
	}
	if _, err := repo.StatBlob(ctx, gone); !errors.Is(err, repository.ErrNotFound) {
		t.Fatalf("KeepAlive stored a missing blob: %v", err)
	}
	if _, err := (&Resolver{Repo: repo}).KeepAlive(ctx, nil); !errors.Is(err, ErrNoRemote) {
		t.Fatalf("KeepAlive without a remote: %v", err)
	}
	age()
	res, err = repository.GC(ctx, repo, repository.GCOptions{Grace: time.Hour})
	if err != nil || len(res.Deleted) != 1 {
		t.Fatalf("GC of an aged, closed, unreferenced blob: %+v %v", res, err)
	}
}

// flaky is a real repository whose blob reads fail while fails > 0 (one
// failure per call), with err.
type flaky struct {
	repository.Repository
	fails atomic.Int64
	calls atomic.Int64
	err   error
}

func (f *flaky) OpenBlob(ctx context.Context, d repository.Digest) (repository.BlobReader, error) {
	br, err := f.Repository.OpenBlob(ctx, d)
	if err != nil {
		return nil, err
	}
	return &flakyReader{BlobReader: br, f: f}, nil
}

type flakyReader struct {
	repository.BlobReader
	f *flaky
}

func (r *flakyReader) ReadAt(ctx context.Context, p []byte, off int64) (int, error) {
	r.f.calls.Add(1)
	if r.f.fails.Add(-1) >= 0 {
		return 0, r.f.err
	}
	return r.BlobReader.ReadAt(ctx, p, off)
}

// A remote read that fails transiently is retried (a sandbox would see an I/O error);
// one that keeps failing, or fails for good (the blob is gone), is reported.
func TestRemoteReadRetries(t *testing.T) {
	repo, err := posixfs.Open(t.TempDir(), posixfs.Options{})
	if err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	data, d := repositorytest.Blob(5, 64<<10)
	if _, err := repo.PutBlob(ctx, d, int64(len(data)), bytes.NewReader(data)); err != nil {
		t.Fatal(err)
	}
	netErr := errors.New("connection reset by peer")
	for _, tc := range []struct {
		name      string
		fails     int64
		err       error
		ok        bool
		wantCalls int64
	}{
		{"healthy", 0, netErr, true, 1},
		{"one transient failure", 1, netErr, true, 2},
		{"two transient failures", 2, netErr, true, 3},
		{"persistent failure", 100, netErr, false, readTries},
		{"blob gone", 100, repository.ErrNotFound, false, 1},
	} {
		t.Run(tc.name, func(t *testing.T) {
			f := &flaky{Repository: repo, err: tc.err}
			r := &Resolver{Repo: f}
			src, err := r.OpenLayer(ctx, stack.LayerRef{Digest: string(d)})
			if err != nil {
				t.Fatal(err)
			}
			defer src.Close()
			f.fails.Store(tc.fails)
			p := make([]byte, 100)
			_, err = src.ReadAt(p, 10)
			if tc.ok != (err == nil) || (err == nil && !bytes.Equal(p, data[10:110])) {
				t.Fatalf("read: %v", err)
			}
			if err != nil && !errors.Is(err, tc.err) {
				t.Fatalf("error %v does not wrap %v", err, tc.err)
			}
			if got := f.calls.Load(); got != tc.wantCalls {
				t.Fatalf("%d reads, want %d", got, tc.wantCalls)
			}
		})
	}
}

// A layer read lazily and its block hash list stay alive together: opening the
// layer and KeepAlive refresh both, so GC takes neither while it is read.
func TestKeepAliveKeepsBlockHashList(t *testing.T) {
	dir := t.TempDir()
	repo, err := posixfs.Open(dir, posixfs.Options{})
	if err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	data, d := repositorytest.Blob(5, 1<<20)
	if _, err := repo.PutBlob(ctx, d, int64(len(data)), bytes.NewReader(data)); err != nil {
		t.Fatal(err)
	}
	h, err := repository.ComputeBlockHashes(bytes.NewReader(data), repository.MinBlockHashChunk)
	if err != nil {
		t.Fatal(err)
	}
	store := &HashStore{Dir: t.TempDir()}
	ld, err := store.Put(d, h)
	if err != nil {
		t.Fatal(err)
	}
	enc := h.Encode()
	if _, err := repo.PutBlob(ctx, ld, int64(len(enc)), bytes.NewReader(enc)); err != nil {
		t.Fatal(err)
	}
	age := func() {
		old := time.Now().Add(-2 * time.Hour)
		for _, x := range []repository.Digest{d, ld} {
			if err := os.Chtimes(filepath.Join(dir, "blobs", "sha256", x.Hex()), old, old); err != nil {
				t.Fatal(err)
			}
		}
	}
	fresh := func(x repository.Digest) bool {
		info, err := repo.StatBlob(ctx, x)
		return err == nil && time.Since(info.LastUsed) < time.Minute
	}
	age()
	r := &Resolver{Repo: repo, Remote: repo, Hashes: store}
	src, err := r.OpenLayer(ctx, stack.LayerRef{Digest: string(d)})
	if err != nil {
		t.Fatal(err)
	}
	defer src.Close()
	r.Wait()
	if !fresh(d) || !fresh(ld) {
		t.Fatalf("open refreshed layer %v, list %v; want both", fresh(d), fresh(ld))
	}
	age()
	if _, err := r.KeepAlive(ctx, nil); err != nil {
		t.Fatal(err)
	}
	if !fresh(d) || !fresh(ld) {
		t.Fatalf("KeepAlive refreshed layer %v, list %v; want both", fresh(d), fresh(ld))
	}
	res, err := repository.GC(ctx, repo, repository.GCOptions{Grace: time.Hour})
	if err != nil || len(res.Deleted) != 0 {
		t.Fatalf("GC took a blob of a layer read lazily: %+v %v", res, err)
	}
}
