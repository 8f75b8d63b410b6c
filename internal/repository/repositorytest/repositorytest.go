// Package repositorytest is the conformance suite for repository
// implementations, in the manner of containerd's snapshotter testsuite: an
// implementation's test calls Run with a constructor of fresh, empty
// repositories and gets every behaviour the consumers rely on checked.
package repositorytest

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"math/rand/v2"
	"testing"
	"time"

	"github.com/aenv-dev/aenv/internal/repository"
)

// NewFunc returns a fresh, empty repository; two calls in one test may
// return two handles on the same store (for multi-writer tests) when
// Shared is used.
type NewFunc func(t *testing.T) repository.Repository

// Run runs the whole suite.
func Run(t *testing.T, newRepo NewFunc) {
	t.Run("PutGet", func(t *testing.T) { testPutGet(t, newRepo(t)) })
	t.Run("Range", func(t *testing.T) { testRange(t, newRepo(t)) })
	t.Run("Dedup", func(t *testing.T) { testDedup(t, newRepo(t)) })
	t.Run("DigestMismatch", func(t *testing.T) { testDigestMismatch(t, newRepo(t)) })
	t.Run("NotFoundAndInvalid", func(t *testing.T) { testNotFound(t, newRepo(t)) })
	t.Run("DeleteBlob", func(t *testing.T) { testDeleteBlob(t, newRepo(t)) })
	t.Run("WalkBlobs", func(t *testing.T) { testWalk(t, newRepo(t)) })
	t.Run("Records", func(t *testing.T) { testRecords(t, newRepo(t)) })
	t.Run("ListPaging", func(t *testing.T) { testListPaging(t, newRepo(t)) })
	t.Run("ConcurrentBlobWriters", func(t *testing.T) { testConcurrentBlobs(t, newRepo(t)) })
	t.Run("ConcurrentRecordWriters", func(t *testing.T) { testConcurrentRecords(t, newRepo(t)) })
	t.Run("GC", func(t *testing.T) { testGC(t, newRepo(t)) })
}

// Blob returns n deterministic pseudo-random bytes and their digest.
func Blob(seed uint64, n int) ([]byte, repository.Digest) {
	b := make([]byte, n)
	r := rand.New(rand.NewPCG(seed, seed^0x9e3779b97f4a7c15))
	for i := 0; i+8 <= n; i += 8 {
		v := r.Uint64()
		for j := 0; j < 8; j++ {
			b[i+j] = byte(v >> (8 * j))
		}
	}
	for i := n - n%8; i < n; i++ {
		b[i] = byte(r.Uint32())
	}
	return b, repository.DigestOf(b)
}

func put(t *testing.T, r repository.Repository, b []byte) repository.Digest {
	t.Helper()
	d := repository.DigestOf(b)
	info, err := r.PutBlob(context.Background(), d, int64(len(b)), bytes.NewReader(b))
	if err != nil {
		t.Fatalf("PutBlob(%d bytes): %v", len(b), err)
	}
	if info.Digest != d || info.Size != int64(len(b)) {
		t.Fatalf("PutBlob info = %+v, want %s size %d", info, d, len(b))
	}
	return d
}

func mustGet(t *testing.T, r repository.Repository, d repository.Digest) []byte {
	t.Helper()
	b, err := repository.ReadAll(context.Background(), r, d)
	if err != nil {
		t.Fatalf("GetBlob %s: %v", d, err)
	}
	return b
}

func testPutGet(t *testing.T, r repository.Repository) {
	ctx := context.Background()
	for _, n := range []int{0, 1, 4096, 1<<20 + 17} {
		t.Run(fmt.Sprint(n), func(t *testing.T) {
			b, d := Blob(uint64(n), n)
			put(t, r, b)
			if got := mustGet(t, r, d); !bytes.Equal(got, b) {
				t.Fatalf("GetBlob returned %d bytes that differ from the %d put", len(got), n)
			}
			info, err := r.StatBlob(ctx, d)
			if err != nil || info.Size != int64(n) || info.Digest != d {
				t.Fatalf("StatBlob = %+v, %v", info, err)
			}
		})
	}
	// Unknown size streams as well.
	b, d := Blob(99, 300<<10)
	if _, err := r.PutBlob(ctx, d, -1, io.MultiReader(bytes.NewReader(b[:1000]), bytes.NewReader(b[1000:]))); err != nil {
		t.Fatalf("PutBlob(size -1): %v", err)
	}
	if got := mustGet(t, r, d); !bytes.Equal(got, b) {
		t.Fatal("unknown-size blob differs")
	}
}

func testRange(t *testing.T, r repository.Repository) {
	ctx := context.Background()
	const n = 3<<20 + 123
	b, d := Blob(7, n)
	put(t, r, b)
	br, err := r.OpenBlob(ctx, d)
	if err != nil {
		t.Fatal(err)
	}
	defer br.Close()
	if br.Size() != n {
		t.Fatalf("Size = %d, want %d", br.Size(), n)
	}
	for _, tc := range []struct {
		name    string
		off     int64
		len     int
		wantN   int
		wantEOF bool
	}{
		{"start", 0, 4096, 4096, false},
		{"middle unaligned", 1<<20 + 3, 70000, 70000, false},
		{"exact end", n - 100, 100, 100, false},
		{"past end", n - 100, 4096, 100, true},
		{"at end", n, 10, 0, true},
		{"beyond end", n + 5000, 10, 0, true},
		{"empty", 10, 0, 0, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			p := make([]byte, tc.len)
			got, err := br.ReadAt(ctx, p, tc.off)
			if got != tc.wantN {
				t.Fatalf("ReadAt(%d, %d) = %d bytes, want %d (err %v)", tc.off, tc.len, got, tc.wantN, err)
			}
			if tc.wantEOF != errors.Is(err, io.EOF) || (!tc.wantEOF && err != nil) {
				t.Fatalf("ReadAt(%d, %d) err = %v, want EOF %v", tc.off, tc.len, err, tc.wantEOF)
			}
			if got > 0 && !bytes.Equal(p[:got], b[tc.off:tc.off+int64(got)]) {
				t.Fatalf("ReadAt(%d, %d) returned wrong bytes", tc.off, tc.len)
			}
		})
	}
}

// failReader fails the test when read: dedup must not consume the stream.
type failReader struct{ t *testing.T }

func (f failReader) Read([]byte) (int, error) {
	f.t.Error("PutBlob read the body of a blob already stored")
	return 0, io.ErrUnexpectedEOF
}

func testDedup(t *testing.T, r repository.Repository) {
	ctx := context.Background()
	b, d := Blob(11, 64<<10)
	put(t, r, b)
	info, err := r.PutBlob(ctx, d, int64(len(b)), failReader{t})
	if err != nil || info.Size != int64(len(b)) {
		t.Fatalf("second PutBlob = %+v, %v", info, err)
	}
	// A dedup with a different declared size is a caller error.
	if _, err := r.PutBlob(ctx, d, int64(len(b))+1, bytes.NewReader(b)); !errors.Is(err, repository.ErrDigestMismatch) {
		t.Fatalf("dedup with wrong size: err = %v, want ErrDigestMismatch", err)
	}
	n := 0
	if err := r.WalkBlobs(ctx, func(repository.BlobInfo) error { n++; return nil }); err != nil || n != 1 {
		t.Fatalf("WalkBlobs saw %d blobs (err %v), want 1", n, err)
	}

	// A dedup counts as a use: GC's conditional delete must keep the blob.
	// S3 times have one-second resolution, hence the sleep.
	time.Sleep(1100 * time.Millisecond)
	cutoff := time.Now().Truncate(time.Second)
	if before, err := r.StatBlob(ctx, d); err != nil || !before.LastUsed.Before(cutoff) {
		t.Fatalf("LastUsed before the dedup = %v (err %v), want before %v", before.LastUsed, err, cutoff)
	}
	if _, err := r.PutBlob(ctx, d, -1, failReader{t}); err != nil {
		t.Fatal(err)
	}
	if after, err := r.StatBlob(ctx, d); err != nil || after.LastUsed.Before(cutoff) {
		t.Fatalf("LastUsed after the dedup = %v (err %v), want ≥ %v", after.LastUsed, err, cutoff)
	}
	if err := r.DeleteBlobIfUnused(ctx, d, cutoff); !errors.Is(err, repository.ErrInUse) {
		t.Fatalf("DeleteBlobIfUnused right after a dedup: %v, want ErrInUse", err)
	}
}

func testDigestMismatch(t *testing.T, r repository.Repository) {
	ctx := context.Background()
	good, d := Blob(21, 100<<10)
	bad := bytes.Clone(good)
	bad[len(bad)/2] ^= 1
	big, bigD := Blob(22, 33<<20) // several parts of a multipart upload
	bigBad := bytes.Clone(big)
	bigBad[len(bigBad)-1] ^= 1
	for _, tc := range []struct {
		name string
		d    repository.Digest
		size int64
		body []byte
	}{
		{"flipped byte", d, int64(len(bad)), bad},
		{"flipped byte unknown size", d, -1, bad},
		{"short body", d, int64(len(good)), good[:len(good)-1]},
		{"long body", d, int64(len(good)), append(bytes.Clone(good), 0)},
		{"declared size wrong", d, int64(len(good)) - 1, good},
		{"multipart last byte", bigD, int64(len(big)), bigBad},
		{"multipart unknown size", bigD, -1, bigBad},
	} {
		t.Run(tc.name, func(t *testing.T) {
			if testing.Short() && len(tc.body) > 1<<20 {
				t.Skip("large blob in -short")
			}
			_, err := r.PutBlob(ctx, tc.d, tc.size, bytes.NewReader(tc.body))
			if !errors.Is(err, repository.ErrDigestMismatch) {
				t.Fatalf("PutBlob err = %v, want ErrDigestMismatch", err)
			}
			if _, err := r.StatBlob(ctx, tc.d); !errors.Is(err, repository.ErrNotFound) {
				t.Fatalf("after a rejected put StatBlob err = %v, want ErrNotFound", err)
			}
		})
	}
	put(t, r, good)
	if got := mustGet(t, r, d); !bytes.Equal(got, good) {
		t.Fatal("good blob differs after rejected puts")
	}
}

func testNotFound(t *testing.T, r repository.Repository) {
	ctx := context.Background()
	_, missing := Blob(31, 10)
	if _, err := r.GetBlob(ctx, missing); !errors.Is(err, repository.ErrNotFound) {
		t.Errorf("GetBlob missing: %v", err)
	}
	if _, err := r.OpenBlob(ctx, missing); !errors.Is(err, repository.ErrNotFound) {
		t.Errorf("OpenBlob missing: %v", err)
	}
	if _, err := r.StatBlob(ctx, missing); !errors.Is(err, repository.ErrNotFound) {
		t.Errorf("StatBlob missing: %v", err)
	}
	if _, err := r.GetRecord(ctx, repository.KindSnapshot, "nope"); !errors.Is(err, repository.ErrNotFound) {
		t.Errorf("GetRecord missing: %v", err)
	}
	for _, bad := range []repository.Digest{"", "sha256:", "sha256:../../etc/passwd", "md5:" + missing[7:], repository.Digest("sha256:" + string(bytes.ToUpper([]byte(missing.Hex()))))} {
		if _, err := r.PutBlob(ctx, bad, 1, bytes.NewReader([]byte{1})); !errors.Is(err, repository.ErrInvalid) {
			t.Errorf("PutBlob(%q): %v, want ErrInvalid", bad, err)
		}
		if _, err := r.StatBlob(ctx, bad); !errors.Is(err, repository.ErrInvalid) {
			t.Errorf("StatBlob(%q): %v, want ErrInvalid", bad, err)
		}
	}
	if _, err := r.PutBlob(ctx, missing, 1, nil); !errors.Is(err, repository.ErrInvalid) {
		t.Errorf("PutBlob(nil reader): %v, want ErrInvalid", err)
	}
	for _, id := range []string{"", "../x", "a/b", ".hidden", string(make([]byte, 200))} {
		if _, err := r.GetRecord(ctx, repository.KindTemplate, id); !errors.Is(err, repository.ErrInvalid) {
			t.Errorf("GetRecord(%q): %v, want ErrInvalid", id, err)
		}
	}
	if _, err := r.ListRecords(ctx, "volume", repository.ListOptions{}); !errors.Is(err, repository.ErrInvalid) {
		t.Errorf("ListRecords(unknown kind): %v, want ErrInvalid", err)
	}
}

func testDeleteBlob(t *testing.T, r repository.Repository) {
	ctx := context.Background()
	b, d := Blob(41, 5000)
	put(t, r, b)
	if err := r.DeleteBlob(ctx, d); err != nil {
		t.Fatal(err)
	}
	if _, err := r.StatBlob(ctx, d); !errors.Is(err, repository.ErrNotFound) {
		t.Fatalf("StatBlob after delete: %v", err)
	}
	if err := r.DeleteBlob(ctx, d); err != nil {
		t.Fatalf("deleting a missing blob: %v", err)
	}
	put(t, r, b) // re-put after delete works
	if got := mustGet(t, r, d); !bytes.Equal(got, b) {
		t.Fatal("re-put blob differs")
	}
}

func testWalk(t *testing.T, r repository.Repository) {
	ctx := context.Background()
	want := map[repository.Digest]int64{}
	for i := range 5 {
		b, d := Blob(uint64(50+i), 1000*(i+1))
		put(t, r, b)
		want[d] = int64(len(b))
	}
	got := map[repository.Digest]int64{}
	if err := r.WalkBlobs(ctx, func(b repository.BlobInfo) error { got[b.Digest] = b.Size; return nil }); err != nil {
		t.Fatal(err)
	}
	if fmt.Sprint(got) != fmt.Sprint(want) {
		t.Fatalf("WalkBlobs = %v, want %v", got, want)
	}
	stop := errors.New("stop")
	if err := r.WalkBlobs(ctx, func(repository.BlobInfo) error { return stop }); !errors.Is(err, stop) {
		t.Fatalf("WalkBlobs did not return the callback's error: %v", err)
	}
}
