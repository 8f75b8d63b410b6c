package nodecache

import (
	"bytes"
	"context"
	"errors"
	"io"
	"os"
	"path/filepath"
	"slices"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/aenv-dev/aenv/internal/repository"
	"github.com/aenv-dev/aenv/internal/repository/posixfs"
	"github.com/aenv-dev/aenv/internal/repository/repositorytest"
	"github.com/aenv-dev/aenv/internal/repository/s3"
	"github.com/aenv-dev/aenv/internal/repository/s3/s3test"
)

func newRemote(t *testing.T) *posixfs.Repo {
	r, err := posixfs.Open(t.TempDir(), posixfs.Options{})
	if err != nil {
		t.Fatal(err)
	}
	return r
}

func open(t *testing.T, remote repository.Repository, dir string, o Options) *Cache {
	t.Helper()
	o.Dir = dir
	c, err := Open(context.Background(), remote, o)
	if err != nil {
		t.Fatal(err)
	}
	return c
}

func TestConformance(t *testing.T) {
	repositorytest.Run(t, func(t *testing.T) repository.Repository {
		return open(t, newRemote(t), t.TempDir(), Options{MaxBytes: 64 << 20})
	})
}

// counting wraps a real repository and counts whole-blob reads.
type counting struct {
	repository.Repository
	gets  atomic.Int64
	delay time.Duration
}

func (c *counting) GetBlob(ctx context.Context, d repository.Digest) (io.ReadCloser, error) {
	c.gets.Add(1)
	time.Sleep(c.delay) // widen the window in which callers overlap
	return c.Repository.GetBlob(ctx, d)
}

func seed(t *testing.T, r repository.Repository, n, size int) []repository.Digest {
	t.Helper()
	var ds []repository.Digest
	for i := range n {
		b, d := repositorytest.Blob(uint64(1000+i), size)
		if _, err := r.PutBlob(context.Background(), d, int64(size), bytes.NewReader(b)); err != nil {
			t.Fatal(err)
		}
		ds = append(ds, d)
	}
	return ds
}

func TestFetchDeduplicated(t *testing.T) {
	remote := &counting{Repository: newRemote(t), delay: 50 * time.Millisecond}
	ds := seed(t, remote, 1, 1<<20)
	c := open(t, remote, t.TempDir(), Options{MaxBytes: 8 << 20})
	var wg sync.WaitGroup
	errs := make([]error, 8)
	for i := range errs {
		wg.Go(func() { errs[i] = c.Fetch(context.Background(), ds[0]) })
	}
	wg.Wait()
	for _, err := range errs {
		if err != nil {
			t.Fatal(err)
		}
	}
	if n := remote.gets.Load(); n != 1 {
		t.Fatalf("8 concurrent fetches read the remote %d times, want 1", n)
	}
	if s := c.Stats(); s.Fetches != 1 || s.FetchedBytes != 1<<20 || s.Entries != 1 {
		t.Fatalf("stats %+v", s)
	}
}

func TestEvictionLRUAndWatermarks(t *testing.T) {
	const blob = 100 << 10
	remote := newRemote(t)
	ds := seed(t, remote, 10, blob)
	// Room for 10 blobs; evict above 8 down to 5.
	c := open(t, remote, t.TempDir(), Options{MaxBytes: 10 * blob, HighWater: 0.8, LowWater: 0.5})
	ctx := context.Background()
	for _, d := range ds[:8] {
		if err := c.Fetch(ctx, d); err != nil {
			t.Fatal(err)
		}
	}
	if s := c.Stats(); s.Entries != 8 || s.Evictions != 0 {
		t.Fatalf("after 8 fetches: %+v", s)
	}
	// Use 0 and 1 so that 2..4 are the least recently used.
	for _, d := range ds[:2] {
		rc, err := c.GetBlob(ctx, d)
		if err != nil {
			t.Fatal(err)
		}
		rc.Close()
	}
	if err := c.Fetch(ctx, ds[8]); err != nil {
		t.Fatal(err)
	}
	// 9 blobs would pass the high mark: evict LRU down to 5 (incl. the new one).
	var cached []int
	for i, d := range ds {
		if c.Cached(d) {
			cached = append(cached, i)
		}
	}
	if want := []int{0, 1, 6, 7, 8}; !slices.Equal(cached, want) {
		t.Fatalf("cached after eviction %v, want %v", cached, want)
	}
	if s := c.Stats(); s.UsedBytes != 5*blob || s.Evictions != 4 {
		t.Fatalf("stats %+v", s)
	}
}

func TestPinsBlockEvictionAndPersist(t *testing.T) {
	const blob = 100 << 10
	remote := newRemote(t)
	ds := seed(t, remote, 6, blob)
	dir := t.TempDir()
	c := open(t, remote, dir, Options{MaxBytes: 4 * blob, HighWater: 1, LowWater: 0.5})
	ctx := context.Background()
	if err := c.Pin("sbx-paused", ds[0], ds[1]); err != nil {
		t.Fatal(err)
	}
	if err := c.Pin("publish-snap", ds[2]); err != nil {
		t.Fatal(err)
	}
	for _, d := range ds[:4] {
		if err := c.Fetch(ctx, d); err != nil {
			t.Fatal(err)
		}
	}
	if err := c.Fetch(ctx, ds[4]); err != nil { // evicts the only unpinned one, 3
		t.Fatal(err)
	}
	if c.Cached(ds[3]) || !c.Cached(ds[0]) || !c.Cached(ds[1]) || !c.Cached(ds[2]) {
		t.Fatal("eviction took a pinned blob or kept the unpinned one")
	}
	// 4 slots, 3 pinned and one open: nothing can make room.
	rd, err := c.OpenBlob(ctx, ds[4])
	if err != nil {
		t.Fatal(err)
	}
	if err := c.Fetch(ctx, ds[5]); !errors.Is(err, ErrCacheFull) {
		t.Fatalf("fetch with everything pinned or open: %v, want ErrCacheFull", err)
	}
	// Reads still work, from the remote.
	rc, err := c.GetBlob(ctx, ds[5])
	if err != nil {
		t.Fatal(err)
	}
	if b, err := io.ReadAll(rc); err != nil || repository.DigestOf(b) != ds[5] {
		t.Fatalf("remote fallback read: %v", err)
	}
	rc.Close()
	rd.Close()

	// Pins survive a restart.
	c2 := open(t, remote, dir, Options{MaxBytes: 4 * blob, HighWater: 1, LowWater: 0.5})
	if got, want := c2.Pinned(), []repository.Digest{ds[0], ds[1], ds[2]}; !slices.Equal(got, sorted(want)) {
		t.Fatalf("pins after restart %v, want %v", got, sorted(want))
	}
	if got := c2.PinOwners(); !slices.Equal(got, []string{"publish-snap", "sbx-paused"}) {
		t.Fatalf("owners after restart %v", got)
	}
	if err := c2.Unpin("publish-snap"); err != nil {
		t.Fatal(err)
	}
	if got := c2.Pinned(); !slices.Equal(got, sorted([]repository.Digest{ds[0], ds[1]})) {
		t.Fatalf("pins after unpin %v", got)
	}
	if err := c2.Pin("../evil", ds[0]); !errors.Is(err, repository.ErrInvalid) {
		t.Fatalf("bad owner: %v", err)
	}
	if err := c2.Pin("ok", "sha256:nothex"); !errors.Is(err, repository.ErrInvalid) {
		t.Fatalf("bad digest: %v", err)
	}
}

func sorted(ds []repository.Digest) []repository.Digest {
	out := slices.Clone(ds)
	slices.Sort(out)
	return out
}

func TestRestartRebuildsIndexAndRechecksDigests(t *testing.T) {
	remote := &counting{Repository: newRemote(t)}
	ds := seed(t, remote, 3, 64<<10)
	dir := t.TempDir()
	c := open(t, remote, dir, Options{MaxBytes: 1 << 20})
	ctx := context.Background()
	for _, d := range ds {
		if err := c.Fetch(ctx, d); err != nil {
			t.Fatal(err)
		}
	}
	// A crash mid-fetch leaves a temp file; a disk error corrupts a blob.
	if err := os.WriteFile(filepath.Join(dir, "tmp", "blob-123"), []byte("partial"), 0o644); err != nil {
		t.Fatal(err)
	}
	bad := filepath.Join(dir, "blobs", "sha256", ds[1].Hex())
	if err := os.Chmod(bad, 0o644); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(bad, bytes.Repeat([]byte{7}, 64<<10), 0o644); err != nil {
		t.Fatal(err)
	}
	before := remote.gets.Load()

	c2 := open(t, remote, dir, Options{MaxBytes: 1 << 20})
	if s := c2.Stats(); s.Entries != 3 || s.UsedBytes != 3*64<<10 {
		t.Fatalf("index after restart %+v", s)
	}
	if ents, _ := os.ReadDir(filepath.Join(dir, "tmp")); len(ents) != 0 {
		t.Fatalf("tmp not emptied: %v", ents)
	}
	for _, d := range ds {
		b, err := repository.ReadAll(ctx, c2, d)
		if err != nil || repository.DigestOf(b) != d {
			t.Fatalf("read %s after restart: %v", d, err)
		}
	}
	if s := c2.Stats(); s.Corrupt != 1 || s.Hits != 3 || s.Misses != 1 {
		t.Fatalf("stats after reading %+v, want 1 corrupt, 3 hits, 1 miss", s)
	}
	if n := remote.gets.Load() - before; n != 1 {
		t.Fatalf("remote reads after restart %d, want 1 (the corrupt blob)", n)
	}

	// VerifyOnOpen checks everything up front.
	if err := os.Chmod(bad, 0o644); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(bad, []byte("short"), 0o644); err != nil {
		t.Fatal(err)
	}
	c3 := open(t, remote, dir, Options{MaxBytes: 1 << 20, VerifyOnOpen: true})
	if s := c3.Stats(); s.Entries != 2 || s.Corrupt != 1 {
		t.Fatalf("after VerifyOnOpen %+v", s)
	}
}

func TestOpenBlobLazyThenLocal(t *testing.T) {
	remote := newRemote(t)
	ds := seed(t, remote, 1, 300<<10)
	ctx := context.Background()
	c := open(t, remote, t.TempDir(), Options{MaxBytes: 1 << 20})
	r, err := c.OpenBlob(ctx, ds[0])
	if err != nil {
		t.Fatal(err)
	}
	p := make([]byte, 100)
	if _, err := r.ReadAt(ctx, p, 1000); err != nil {
		t.Fatal(err)
	}
	r.Close()
	if c.Cached(ds[0]) || c.Stats().RemoteReads != 1 {
		t.Fatalf("lazy open cached the blob: %+v", c.Stats())
	}
	eager := open(t, remote, t.TempDir(), Options{MaxBytes: 1 << 20, FetchOnOpen: true})
	r, err = eager.OpenBlob(ctx, ds[0])
	if err != nil {
		t.Fatal(err)
	}
	q := make([]byte, 100)
	if _, err := r.ReadAt(ctx, q, 1000); err != nil || !bytes.Equal(p, q) {
		t.Fatalf("local read differs (err %v)", err)
	}
	r.Close()
	if !eager.Cached(ds[0]) {
		t.Fatal("FetchOnOpen did not cache")
	}
}

func TestPutLocalThenPublish(t *testing.T) {
	remote := newRemote(t)
	ctx := context.Background()
	c := open(t, remote, t.TempDir(), Options{MaxBytes: 1 << 20})
	b, d := repositorytest.Blob(5, 200<<10)
	if _, err := c.PutLocal(ctx, d, int64(len(b)), bytes.NewReader(b)); err != nil {
		t.Fatal(err)
	}
	if _, err := remote.StatBlob(ctx, d); !errors.Is(err, repository.ErrNotFound) {
		t.Fatalf("PutLocal reached the remote: %v", err)
	}
	if !c.Cached(d) {
		t.Fatal("not cached")
	}
	if _, err := c.Publish(ctx, d); err != nil {
		t.Fatal(err)
	}
	if got, err := repository.ReadAll(ctx, remote, d); err != nil || !bytes.Equal(got, b) {
		t.Fatalf("published blob: %v", err)
	}
	_, missing := repositorytest.Blob(6, 10)
	if _, err := c.Publish(ctx, missing); !errors.Is(err, repository.ErrNotFound) {
		t.Fatalf("publishing an uncached blob: %v", err)
	}
	// A blob larger than the cache goes straight to the remote.
	big, bigD := repositorytest.Blob(7, 2<<20)
	if _, err := c.PutBlob(ctx, bigD, int64(len(big)), bytes.NewReader(big)); err != nil {
		t.Fatal(err)
	}
	if c.Cached(bigD) {
		t.Fatal("oversized blob cached")
	}
	if _, err := remote.StatBlob(ctx, bigD); err != nil {
		t.Fatalf("oversized blob not published: %v", err)
	}
}

func TestOptionsRejected(t *testing.T) {
	for _, o := range []Options{{MaxBytes: 0}, {MaxBytes: 10, HighWater: 0.5, LowWater: 0.9}, {MaxBytes: 10, HighWater: 1.5}} {
		o.Dir = t.TempDir()
		if _, err := Open(context.Background(), newRemote(t), o); !errors.Is(err, repository.ErrInvalid) {
			t.Errorf("Open(%+v) = %v, want ErrInvalid", o, err)
		}
	}
}

// The cache in front of a real S3 server passes the same suite.
func TestConformanceOverS3(t *testing.T) {
	srv := s3test.Start(t)
	repositorytest.Run(t, func(t *testing.T) repository.Repository {
		remote, err := s3.Open(context.Background(), s3.Config{
			Endpoint: srv.Endpoint, Bucket: srv.Bucket(t), Addressing: s3.AddressPath,
			AccessKey: s3test.AccessKey, SecretKey: s3test.SecretKey,
		})
		if err != nil {
			t.Fatal(err)
		}
		return open(t, remote, t.TempDir(), Options{MaxBytes: 64 << 20})
	})
}

// Two nodes, each with its own cache, share one S3 repository: what node A
// publishes (blob, then record marked complete) node B lists, fetches once
// and reads locally; GC spares what node B pins.
func TestTwoNodesShareS3(t *testing.T) {
	srv := s3test.Start(t)
	ctx := context.Background()
	remote, err := s3.Open(ctx, s3.Config{
		Endpoint: srv.Endpoint, Bucket: srv.Bucket(t), Addressing: s3.AddressPath,
		AccessKey: s3test.AccessKey, SecretKey: s3test.SecretKey,
	})
	if err != nil {
		t.Fatal(err)
	}
	nodeA := open(t, remote, t.TempDir(), Options{MaxBytes: 16 << 20})
	nodeB := open(t, remote, t.TempDir(), Options{MaxBytes: 16 << 20, FetchOnOpen: true})

	layer, d := repositorytest.Blob(42, 3<<20)
	rec, err := nodeA.PutRecord(ctx, repositorytest.Record(repository.KindSnapshot, "snap-a", d))
	if err != nil {
		t.Fatal(err)
	}
	if err := nodeA.Pin("publish-snap-a", d); err != nil {
		t.Fatal(err)
	}
	if _, err := nodeA.PutLocal(ctx, d, int64(len(layer)), bytes.NewReader(layer)); err != nil {
		t.Fatal(err)
	}
	if _, err := nodeA.Publish(ctx, d); err != nil {
		t.Fatal(err)
	}
	rec.State = repository.StateComplete
	if _, err := nodeA.PutRecord(ctx, rec); err != nil {
		t.Fatal(err)
	}
	if err := nodeA.Unpin("publish-snap-a"); err != nil {
		t.Fatal(err)
	}

	page, err := nodeB.ListRecords(ctx, repository.KindSnapshot, repository.ListOptions{})
	if err != nil || len(page.Records) != 1 || page.Records[0].State != repository.StateComplete {
		t.Fatalf("node B lists %+v (err %v)", page.Records, err)
	}
	got := page.Records[0]
	if err := nodeB.Pin("sbx-on-b", got.Digests()...); err != nil {
		t.Fatal(err)
	}
	br, err := nodeB.OpenBlob(ctx, got.Layers[0].Digest)
	if err != nil {
		t.Fatal(err)
	}
	p := make([]byte, 4096)
	if _, err := br.ReadAt(ctx, p, 1<<20); err != nil || !bytes.Equal(p, layer[1<<20:1<<20+4096]) {
		t.Fatalf("node B read: %v", err)
	}
	br.Close()
	if !nodeB.Cached(d) {
		t.Fatal("node B did not cache the layer")
	}

	// The snapshot is deleted while node B still runs a sandbox on it.
	if err := nodeA.DeleteRecord(ctx, repository.KindSnapshot, "snap-a"); err != nil {
		t.Fatal(err)
	}
	res, err := repository.GC(ctx, nodeA, repository.GCOptions{Grace: -1, Pinned: nodeB.Pinned()})
	if err != nil || len(res.Deleted) != 0 {
		t.Fatalf("GC with node B's pins deleted %v (err %v)", res.Deleted, err)
	}
	if err := nodeB.Unpin("sbx-on-b"); err != nil {
		t.Fatal(err)
	}
	res, err = repository.GC(ctx, nodeA, repository.GCOptions{Grace: -1, Pinned: nodeB.Pinned()})
	if err != nil || len(res.Deleted) != 1 || res.Deleted[0] != d {
		t.Fatalf("GC after unpin deleted %v (err %v), want %s", res.Deleted, err, d)
	}
}
