package layers

import (
	"bytes"
	"context"
	"errors"
	"io"
	"testing"

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
