package p2p

import (
	"context"
	"crypto/rand"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"io"
	"net/http/httptest"
	"os"
	"slices"
	"strconv"
	"sync"
	"testing"
	"time"

	"github.com/aenv-dev/aenv/internal/repository"
	"github.com/aenv-dev/aenv/internal/repository/nodecache"
	"github.com/aenv-dev/aenv/internal/repository/s3"
	"github.com/aenv-dev/aenv/internal/repository/s3/s3test"
	"github.com/aenv-dev/aenv/internal/storage/cache"
)

// BenchmarkThreeNodesObtainLayer: three nodes each read a whole layer (1 GiB, or
// AENV_P2P_BENCH_MB) in 1 MiB chunks, four at a time as the block cache's readahead
// does, every chunk verified against the layer's block hash list; one op is the time
// until all three have it. "repository": every node reads the real S3 server
// (versitygw); "p2p": a fourth node that published the layer holds it in its node
// cache and serves it to the three. Run with -benchtime=Nx; median-s is the median of the N.
func BenchmarkThreeNodesObtainLayer(b *testing.B) {
	size := int64(1 << 30)
	if v, err := strconv.Atoi(os.Getenv("AENV_P2P_BENCH_MB")); err == nil && v > 0 {
		size = int64(v) << 20
	}
	ctx := context.Background()
	srv := s3test.Start(b) // skips when versitygw is missing
	repo, err := s3.Open(ctx, s3.Config{Endpoint: srv.Endpoint, Bucket: srv.Bucket(b), Addressing: s3.AddressPath,
		AccessKey: s3test.AccessKey, SecretKey: s3test.SecretKey})
	if err != nil {
		b.Fatal(err)
	}
	// The publisher's node cache holds the layer whole: it writes it, uploads it and
	// hashes it in one pass, as a node publishing a snapshot does.
	seed, err := nodecache.Open(ctx, repo, nodecache.Options{Dir: b.TempDir(), MaxBytes: 4 * size})
	if err != nil {
		b.Fatal(err)
	}
	pr, pw := io.Pipe()
	go func() {
		_, err := io.CopyN(pw, rand.Reader, size)
		pw.CloseWithError(err)
	}()
	tmp, err := os.CreateTemp(b.TempDir(), "layer")
	if err != nil {
		b.Fatal(err)
	}
	sha := sha256.New()
	h, err := repository.ComputeBlockHashes(io.TeeReader(pr, io.MultiWriter(tmp, sha)), repository.DefaultBlockHashChunk)
	if err != nil {
		b.Fatal(err)
	}
	d := repository.Digest("sha256:" + hex.EncodeToString(sha.Sum(nil)))
	if _, err := tmp.Seek(0, io.SeekStart); err != nil {
		b.Fatal(err)
	}
	if _, err := seed.PutBlob(ctx, d, size, tmp); err != nil {
		b.Fatal(err)
	}
	tmp.Close()
	os.Remove(tmp.Name())
	sums := &cache.Sums{Chunk: h.Chunk, Sums: h.Sums}
	seedSrv, err := NewServer(ServerOptions{Blobs: seed, Token: testToken})
	if err != nil {
		b.Fatal(err)
	}
	hs := httptest.NewServer(seedSrv)
	defer hs.Close()

	obtain := func(b *testing.B, wrap func(repository.BlobReader) repository.BlobReader) {
		var wg sync.WaitGroup
		errs := make(chan error, 3)
		for range 3 {
			wg.Go(func() {
				br, err := repo.OpenBlob(ctx, d)
				if err != nil {
					errs <- err
					return
				}
				r := wrap(br)
				defer r.Close()
				errs <- readVerified(ctx, r, sums)
			})
		}
		wg.Wait()
		close(errs)
		for err := range errs {
			if err != nil {
				b.Fatal(err)
			}
		}
	}
	b.Run("repository", func(b *testing.B) {
		b.SetBytes(3 * size)
		var took []time.Duration
		for b.Loop() {
			start := time.Now()
			obtain(b, func(br repository.BlobReader) repository.BlobReader { return br })
			took = append(took, time.Since(start))
		}
		reportMedian(b, took)
	})
	b.Run("p2p", func(b *testing.B) {
		b.SetBytes(3 * size)
		var took []time.Duration
		for b.Loop() {
			start := time.Now()
			// Each node has its own fetcher, as each node process does.
			fs := make([]*Fetcher, 0, 3)
			obtain(b, func(br repository.BlobReader) repository.BlobReader {
				f := newFetcher(b, staticPeers{hs.URL}, testToken)
				fs = append(fs, f)
				return f.Wrap(d, br, sums)
			})
			for _, f := range fs {
				if st := f.Stats(); st.RepositoryBytes != 0 {
					b.Fatalf("a node read %d bytes from the repository", st.RepositoryBytes)
				}
			}
			took = append(took, time.Since(start))
		}
		reportMedian(b, took)
	})
}

// reportMedian reports the median time for all three nodes to have the layer.
func reportMedian(b *testing.B, took []time.Duration) {
	slices.Sort(took)
	b.ReportMetric(took[len(took)/2].Seconds(), "median-s")
}

// readVerified reads r whole in 1 MiB chunks, four at a time, checking each against sums.
func readVerified(ctx context.Context, r repository.BlobReader, sums *cache.Sums) error {
	n := (r.Size() + sums.Chunk - 1) / sums.Chunk
	var next int64
	var mu sync.Mutex
	errs := make(chan error, 4)
	for range 4 {
		go func() {
			buf := make([]byte, sums.Chunk)
			for {
				mu.Lock()
				j := next
				next++
				mu.Unlock()
				if j >= n {
					errs <- nil
					return
				}
				p := buf[:min(sums.Chunk, r.Size()-j*sums.Chunk)]
				if got, err := r.ReadAt(ctx, p, j*sums.Chunk); got != len(p) {
					errs <- errors.Join(errors.New("short read"), err)
					return
				}
				if err := sums.Check("layer", p, j*sums.Chunk); err != nil {
					errs <- err
					return
				}
			}
		}()
	}
	var first error
	for range 4 {
		if err := <-errs; err != nil && first == nil {
			first = err
		}
	}
	return first
}
