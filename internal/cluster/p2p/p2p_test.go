package p2p

import (
	"bytes"
	"context"
	"crypto/rand"
	"errors"
	"io"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"sync/atomic"
	"testing"
	"time"

	"github.com/aenv-dev/aenv/internal/repository"
	"github.com/aenv-dev/aenv/internal/repository/nodecache"
	"github.com/aenv-dev/aenv/internal/repository/posixfs"
	"github.com/aenv-dev/aenv/internal/storage/cache"
)

const (
	testToken = "p2p-test-token-0123456789"
	testChunk = 64 << 10
)

// fixture is a posix_fs repository holding one blob with its block sums.
type fixture struct {
	repo *posixfs.Repo
	d    repository.Digest
	data []byte
	sums *cache.Sums
}

func newFixture(t testing.TB, size int) *fixture {
	t.Helper()
	data := make([]byte, size)
	rand.Read(data)
	repo, err := posixfs.Open(t.TempDir(), posixfs.Options{})
	if err != nil {
		t.Fatal(err)
	}
	d := repository.DigestOf(data)
	if _, err := repo.PutBlob(context.Background(), d, int64(size), bytes.NewReader(data)); err != nil {
		t.Fatal(err)
	}
	h, err := repository.ComputeBlockHashes(bytes.NewReader(data), testChunk)
	if err != nil {
		t.Fatal(err)
	}
	return &fixture{repo: repo, d: d, data: data, sums: &cache.Sums{Chunk: h.Chunk, Sums: h.Sums}}
}

// peer is a real node cache holding the fixture's blob whole, served over HTTP.
type peer struct {
	url   string
	cache *nodecache.Cache
	srv   *Server
	dir   string
}

func (fx *fixture) peer(t testing.TB, o ServerOptions) *peer {
	t.Helper()
	dir := t.TempDir()
	nc, err := nodecache.Open(context.Background(), fx.repo, nodecache.Options{Dir: dir, MaxBytes: 1 << 32})
	if err != nil {
		t.Fatal(err)
	}
	if err := nc.Fetch(context.Background(), fx.d); err != nil {
		t.Fatal(err)
	}
	o.Blobs, o.Token = nc, testToken
	srv, err := NewServer(o)
	if err != nil {
		t.Fatal(err)
	}
	hs := httptest.NewServer(srv)
	t.Cleanup(hs.Close)
	return &peer{url: hs.URL, cache: nc, srv: srv, dir: dir}
}

// corrupt flips a byte of chunk j of the peer's copy on disk.
func (p *peer) corrupt(t testing.TB, d repository.Digest, j int64) {
	t.Helper()
	f, err := os.OpenFile(filepath.Join(p.dir, "blobs", "sha256", d.Hex()), os.O_RDWR, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	b := make([]byte, 1)
	if _, err := f.ReadAt(b, j*testChunk+100); err != nil {
		t.Fatal(err)
	}
	b[0] ^= 0xff
	if _, err := f.WriteAt(b, j*testChunk+100); err != nil {
		t.Fatal(err)
	}
}

type staticPeers []string

func (s staticPeers) Peers(context.Context, repository.Digest) ([]string, error) { return s, nil }

type failingPeers struct{}

func (failingPeers) Peers(context.Context, repository.Digest) ([]string, error) {
	return nil, errors.New("scheduler unreachable")
}

// countingBlob counts what is read from the repository.
type countingBlob struct {
	repository.BlobReader
	n *atomic.Int64
}

func (c countingBlob) ReadAt(ctx context.Context, p []byte, off int64) (int, error) {
	n, err := c.BlobReader.ReadAt(ctx, p, off)
	c.n.Add(int64(n))
	return n, err
}

// open wraps the fixture's repository blob with f and counts the repository's bytes.
func (fx *fixture) open(t testing.TB, f *Fetcher) (repository.BlobReader, *atomic.Int64) {
	t.Helper()
	br, err := fx.repo.OpenBlob(context.Background(), fx.d)
	if err != nil {
		t.Fatal(err)
	}
	n := &atomic.Int64{}
	r := f.Wrap(fx.d, countingBlob{br, n}, fx.sums)
	t.Cleanup(func() { r.Close() })
	return r, n
}

func newFetcher(t testing.TB, peers PeerLister, token string) *Fetcher {
	t.Helper()
	f, err := NewFetcher(FetcherOptions{Peers: peers, Token: token, Timeout: 10 * time.Second})
	if err != nil {
		t.Fatal(err)
	}
	return f
}

// readAll reads r whole in reads of step bytes (unaligned when step is not a chunk
// multiple), several reads at a time, as the block cache's prefetches do.
func readAll(t testing.TB, r repository.BlobReader, step int) []byte {
	t.Helper()
	out := make([]byte, r.Size())
	errs := make(chan error, 4)
	for w := range 4 {
		go func() {
			for off := w * step; off < len(out); off += 4 * step {
				p := out[off:min(off+step, len(out))]
				n, err := r.ReadAt(context.Background(), p, int64(off))
				if n != len(p) || (err != nil && !errors.Is(err, io.EOF)) {
					errs <- errors.Join(errors.New("short read"), err)
					return
				}
			}
			errs <- nil
		}()
	}
	for range 4 {
		if err := <-errs; err != nil {
			t.Fatal(err)
		}
	}
	return out
}

func TestReadsFromPeers(t *testing.T) {
	fx := newFixture(t, 40*testChunk+1234) // a short last chunk
	a, b := fx.peer(t, ServerOptions{}), fx.peer(t, ServerOptions{})
	for _, tt := range []struct {
		name string
		step int
	}{
		{"chunk reads", testChunk},
		{"multi-chunk reads", 5 * testChunk},
		{"unaligned reads", 3*testChunk/2 + 7},
	} {
		t.Run(tt.name, func(t *testing.T) {
			sa, sb := a.srv.Stats().ServedBytes, b.srv.Stats().ServedBytes
			f := newFetcher(t, staticPeers{a.url, b.url}, testToken)
			r, repoBytes := fx.open(t, f)
			if got := readAll(t, r, tt.step); !bytes.Equal(got, fx.data) {
				t.Fatal("the bytes read through peers differ from the blob")
			}
			st := f.Stats()
			if repoBytes.Load() != 0 || st.RepositoryBytes != 0 || st.BadChunks != 0 || st.PeerErrors != 0 {
				t.Fatalf("read %d bytes from the repository, stats %+v; want all from peers", repoBytes.Load(), st)
			}
			// Both peers served: chunks are spread over them.
			da, db := a.srv.Stats().ServedBytes-sa, b.srv.Stats().ServedBytes-sb
			if da == 0 || db == 0 || st.PeerBytes < int64(len(fx.data)) {
				t.Fatalf("peer A served %d bytes, B %d, fetched %d of %d", da, db, st.PeerBytes, len(fx.data))
			}
		})
	}
	// Past the end: EOF, nothing read.
	f := newFetcher(t, staticPeers{a.url}, testToken)
	r, _ := fx.open(t, f)
	p := make([]byte, 10)
	if n, err := r.ReadAt(context.Background(), p, int64(len(fx.data))); n != 0 || err != io.EOF {
		t.Fatalf("read at the end: %d, %v", n, err)
	}
	if n, err := r.ReadAt(context.Background(), p, int64(len(fx.data))-4); n != 4 || err != io.EOF ||
		!bytes.Equal(p[:4], fx.data[len(fx.data)-4:]) {
		t.Fatalf("read over the end: %d, %v", n, err)
	}
}

func TestCorruptChunkReadFromRepository(t *testing.T) {
	fx := newFixture(t, 16*testChunk)
	a, b := fx.peer(t, ServerOptions{}), fx.peer(t, ServerOptions{})
	a.corrupt(t, fx.d, 4) // chunk 4 goes to peer A (4 mod 2)
	f := newFetcher(t, staticPeers{a.url, b.url}, testToken)
	r, repoBytes := fx.open(t, f)
	if got := readAll(t, r, testChunk); !bytes.Equal(got, fx.data) {
		t.Fatal("a corrupt peer chunk reached the reader")
	}
	st := f.Stats()
	if st.BadChunks != 1 || repoBytes.Load() < testChunk || st.RepositoryBytes != repoBytes.Load() {
		t.Fatalf("stats %+v, %d bytes from the repository; want one bad chunk read from the repository", st, repoBytes.Load())
	}
	// After the bad chunk, A is not asked for this layer again (backoff): its other
	// even chunks came from the repository or from B, never wrong.
	if st.PeerBytes+st.RepositoryBytes != int64(len(fx.data)) {
		t.Fatalf("peer %d + repository %d bytes != %d", st.PeerBytes, st.RepositoryBytes, len(fx.data))
	}
}

func TestMissingPeersFallBack(t *testing.T) {
	fx := newFixture(t, 8*testChunk)
	other := newFixture(t, testChunk) // a peer that holds another blob only: 404
	empty := other.peer(t, ServerOptions{})
	dead := httptest.NewServer(http.NotFoundHandler())
	deadURL := dead.URL
	dead.Close() // connection refused
	for _, tt := range []struct {
		name       string
		peers      PeerLister
		peerErrors bool
	}{
		{"no peers", staticPeers{}, false},
		{"scheduler down", failingPeers{}, false},
		{"dead peer", staticPeers{deadURL}, true},
		{"peer without the blob", staticPeers{empty.url}, true},
	} {
		t.Run(tt.name, func(t *testing.T) {
			f := newFetcher(t, tt.peers, testToken)
			r, repoBytes := fx.open(t, f)
			if got := readAll(t, r, testChunk); !bytes.Equal(got, fx.data) {
				t.Fatal("wrong bytes")
			}
			st := f.Stats()
			if repoBytes.Load() != int64(len(fx.data)) || st.PeerBytes != 0 || (st.PeerErrors > 0) != tt.peerErrors {
				t.Fatalf("stats %+v, %d bytes from the repository", st, repoBytes.Load())
			}
		})
	}
}

func TestPeerNeedsToken(t *testing.T) {
	fx := newFixture(t, 4*testChunk)
	a := fx.peer(t, ServerOptions{})
	for _, auth := range []string{"", "Bearer wrong-token-0123456789", testToken} {
		req, _ := http.NewRequest(http.MethodGet, a.url+BlobPath+string(fx.d), nil)
		if auth != "" {
			req.Header.Set("Authorization", auth)
		}
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		resp.Body.Close()
		if resp.StatusCode != http.StatusUnauthorized {
			t.Fatalf("Authorization %q: status %d, want 401", auth, resp.StatusCode)
		}
	}
	if st := a.srv.Stats(); st.Refused != 3 || st.ServedBytes != 0 {
		t.Fatalf("server stats %+v", st)
	}
	// A fetcher with the wrong token reads everything from the repository.
	f := newFetcher(t, staticPeers{a.url}, "wrong-token-0123456789")
	r, repoBytes := fx.open(t, f)
	if got := readAll(t, r, testChunk); !bytes.Equal(got, fx.data) || repoBytes.Load() != int64(len(fx.data)) {
		t.Fatalf("wrong token: %d bytes from the repository", repoBytes.Load())
	}
	// Bad paths and digests are refused without touching the cache.
	for path, want := range map[string]int{
		BlobPath + "sha256:zz": http.StatusBadRequest,
		"/other":               http.StatusNotFound,
		BlobPath + string(repository.DigestOf([]byte("x"))): http.StatusNotFound,
	} {
		req, _ := http.NewRequest(http.MethodGet, a.url+path, nil)
		req.Header.Set("Authorization", "Bearer "+testToken)
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		resp.Body.Close()
		if resp.StatusCode != want {
			t.Fatalf("GET %s: %d, want %d", path, resp.StatusCode, want)
		}
	}
}

// The upload bound is a token bucket: serving N bytes at R bytes/s cannot take less than
// (N - burst) / R, however fast the machine.
func TestUploadBound(t *testing.T) {
	const rate = 4 << 20
	fx := newFixture(t, 48*testChunk) // 3 MiB
	a := fx.peer(t, ServerOptions{UploadBytesPerSec: rate})
	f := newFetcher(t, staticPeers{a.url}, testToken)
	r, repoBytes := fx.open(t, f)
	start := time.Now()
	if got := readAll(t, r, 4*testChunk); !bytes.Equal(got, fx.data) || repoBytes.Load() != 0 {
		t.Fatalf("bounded peer: %d bytes from the repository", repoBytes.Load())
	}
	floor := time.Duration(float64(len(fx.data)-burst) / rate * float64(time.Second))
	if took := time.Since(start); took < floor {
		t.Fatalf("served %d bytes at %d B/s in %v, under the bound's floor %v", len(fx.data), rate, took, floor)
	}
	if _, err := NewServer(ServerOptions{Blobs: a.cache, Token: testToken, UploadBytesPerSec: -1}); err == nil {
		t.Fatal("a negative bound was accepted")
	}
}
