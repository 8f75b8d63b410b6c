package layers

import (
	"bytes"
	"context"
	"errors"
	"io"
	"os"
	"path/filepath"
	"testing"

	"github.com/aenv-dev/aenv/internal/repository"
	"github.com/aenv-dev/aenv/internal/repository/posixfs"
	"github.com/aenv-dev/aenv/internal/repository/repositorytest"
	"github.com/aenv-dev/aenv/internal/storage/cache"
	"github.com/aenv-dev/aenv/internal/storage/stack"
)

// publishWithHashes puts a blob and its block hash list into repo, as the
// snapshot publisher does, and returns the record's layer entry.
func publishWithHashes(t testing.TB, repo repository.Repository, data []byte, d repository.Digest, chunk int64) repository.Layer {
	t.Helper()
	ctx := context.Background()
	if _, err := repo.PutBlob(ctx, d, int64(len(data)), bytes.NewReader(data)); err != nil {
		t.Fatal(err)
	}
	h, err := repository.ComputeBlockHashes(bytes.NewReader(data), chunk)
	if err != nil {
		t.Fatal(err)
	}
	enc := h.Encode()
	if _, err := repo.PutBlob(ctx, h.Digest(), int64(len(enc)), bytes.NewReader(enc)); err != nil {
		t.Fatal(err)
	}
	return repository.Layer{Role: "rootfs", Digest: d, Size: int64(len(data)), BlockHashes: h.Digest()}
}

// corruptByte flips one byte of a blob stored in a posix_fs repository at dir.
func corruptByte(t testing.TB, dir string, d repository.Digest, off int64) {
	t.Helper()
	path := filepath.Join(dir, "blobs", "sha256", d.Hex())
	os.Chmod(path, 0o644)
	f, err := os.OpenFile(path, os.O_RDWR, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	b := []byte{0}
	if _, err := f.ReadAt(b, off); err != nil {
		t.Fatal(err)
	}
	b[0] ^= 0x5a
	if _, err := f.WriteAt(b, off); err != nil {
		t.Fatal(err)
	}
}

// TestVerifiedLazyReads: a byte corrupted in the repository after
// publication fails the reads of its block with cache.ErrVerify while every
// other block reads; intact layers and layers published without a list
// (older records) read as before.
func TestVerifiedLazyReads(t *testing.T) {
	ctx := context.Background()
	const size = 5<<20 + 333
	bad := int64(2<<20 + 4097)
	for _, tc := range []struct {
		name   string
		cached bool
		chunk  int64
	}{
		{"block cache, chunk = block", true, 1 << 20},
		{"block cache, chunk < block", true, 256 << 10},
		{"block cache, chunk > block", true, 4 << 20},
		{"direct", false, 1 << 20},
	} {
		t.Run(tc.name, func(t *testing.T) {
			dir := t.TempDir()
			repo, err := posixfs.Open(dir, posixfs.Options{})
			if err != nil {
				t.Fatal(err)
			}
			store := &HashStore{Dir: t.TempDir()}
			r := &Resolver{Repo: repo, Hashes: store}
			if tc.cached {
				bc, err := cache.Open(cache.Options{Dir: t.TempDir(), MaxBytes: 64 << 20})
				if err != nil {
					t.Fatal(err)
				}
				defer bc.Close()
				r.Cache = bc
			}
			intact, di := repositorytest.Blob(1, size)
			corrupt, dc := repositorytest.Blob(2, size)
			old, do := repositorytest.Blob(3, size)
			for _, l := range []repository.Layer{
				publishWithHashes(t, repo, intact, di, tc.chunk),
				publishWithHashes(t, repo, corrupt, dc, tc.chunk),
			} {
				if err := store.Learn(ctx, repo, l); err != nil {
					t.Fatal(err)
				}
			}
			if _, err := repo.PutBlob(ctx, do, size, bytes.NewReader(old)); err != nil {
				t.Fatal(err)
			}
			corruptByte(t, dir, dc, bad)
			corruptByte(t, dir, do, bad) // unverifiable: read as stored

			unit := max(tc.chunk, 1<<20)
			if !tc.cached {
				unit = tc.chunk
			}
			for _, b := range []struct {
				d    repository.Digest
				want []byte
				bad  bool
			}{{di, intact, false}, {dc, corrupt, true}, {do, old, false}} {
				src, err := r.OpenLayer(ctx, stack.LayerRef{Digest: string(b.d), Size: size})
				if err != nil {
					t.Fatal(err)
				}
				want := b.want
				if b.d == do {
					want = bytes.Clone(old)
					want[bad] ^= 0x5a
				}
				p := make([]byte, 64<<10)
				for off := int64(0); off < size; off += int64(len(p)) {
					n, err := src.ReadAt(p, off)
					inBad := b.bad && off/unit == bad/unit
					switch {
					case inBad && !errors.Is(err, cache.ErrVerify):
						t.Fatalf("%s: ReadAt(%d) of the corrupt block = %d, %v; want ErrVerify", b.d, off, n, err)
					case !inBad && err != nil && err != io.EOF:
						t.Fatalf("%s: ReadAt(%d): %v", b.d, off, err)
					case !inBad && !bytes.Equal(p[:n], want[off:off+int64(n)]):
						t.Fatalf("%s: ReadAt(%d): wrong bytes", b.d, off)
					}
				}
				src.Close()
			}
			if r.VerifyFailures() == 0 {
				t.Fatal("no verify failure counted")
			}
		})
	}
}

// TestHashStoreLearn: a list is fetched once, checked against the digest
// the record names and the layer's size; a wrong one is refused.
func TestHashStoreLearn(t *testing.T) {
	ctx := context.Background()
	repo, err := posixfs.Open(t.TempDir(), posixfs.Options{})
	if err != nil {
		t.Fatal(err)
	}
	data, d := repositorytest.Blob(4, 3<<20)
	l := publishWithHashes(t, repo, data, d, 1<<20)
	store := &HashStore{Dir: t.TempDir()}
	if h, err := store.BlockHashes(ctx, d); h != nil || err != nil {
		t.Fatalf("empty store: %v, %v", h, err)
	}
	for name, tc := range map[string]struct {
		l    repository.Layer
		want error
	}{
		"missing list": {repository.Layer{Digest: d, Size: l.Size, BlockHashes: repository.DigestOf([]byte("x"))}, repository.ErrNotFound},
		"wrong size":   {repository.Layer{Digest: d, Size: l.Size + 1, BlockHashes: l.BlockHashes}, repository.ErrDigestMismatch},
		"not a list":   {repository.Layer{Digest: d, Size: l.Size, BlockHashes: d}, repository.ErrInvalid},
	} {
		if err := store.Learn(ctx, repo, tc.l); !errors.Is(err, tc.want) {
			t.Errorf("%s: %v, want %v", name, err, tc.want)
		}
	}
	if h, _ := store.BlockHashes(ctx, d); h != nil {
		t.Fatal("a refused list was stored")
	}
	if err := store.Learn(ctx, repo, l); err != nil {
		t.Fatal(err)
	}
	h, err := store.BlockHashes(ctx, d)
	if err != nil || h == nil || h.Digest() != l.BlockHashes || len(h.Sums) != 3 {
		t.Fatalf("stored list: %+v, %v", h, err)
	}
}
