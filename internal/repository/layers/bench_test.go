package layers

import (
	"context"
	"fmt"
	"testing"

	"github.com/aenv-dev/aenv/internal/repository"
	"github.com/aenv-dev/aenv/internal/repository/posixfs"
	"github.com/aenv-dev/aenv/internal/repository/repositorytest"
	"github.com/aenv-dev/aenv/internal/storage/cache"
	"github.com/aenv-dev/aenv/internal/storage/stack"
)

// BenchmarkLazyColdRead reads a 64 MiB layer from a posix_fs repository
// through an empty block cache (1 MiB blocks, no readahead), 128 KiB at a
// time, with and without block hash verification: the cost of verifying
// a cold lazy read.
func BenchmarkLazyColdRead(b *testing.B) {
	const size = 64 << 20
	ctx := context.Background()
	repo, err := posixfs.Open(b.TempDir(), posixfs.Options{})
	if err != nil {
		b.Fatal(err)
	}
	data, d := repositorytest.Blob(9, size)
	l := publishWithHashes(b, repo, data, d, repository.DefaultBlockHashChunk)
	store := &HashStore{Dir: b.TempDir()}
	if err := store.Learn(ctx, repo, l); err != nil {
		b.Fatal(err)
	}
	for _, verified := range []bool{false, true} {
		b.Run(fmt.Sprintf("verified=%v", verified), func(b *testing.B) {
			b.SetBytes(size)
			p := make([]byte, 128<<10)
			for b.Loop() {
				b.StopTimer()
				bc, err := cache.Open(cache.Options{Dir: b.TempDir(), MaxBytes: 256 << 20})
				if err != nil {
					b.Fatal(err)
				}
				r := &Resolver{Repo: repo, Cache: bc}
				if verified {
					r.Hashes = store
				}
				b.StartTimer()
				src, err := r.OpenLayer(ctx, stack.LayerRef{Digest: string(d), Size: size})
				if err != nil {
					b.Fatal(err)
				}
				for off := int64(0); off < size; off += int64(len(p)) {
					if _, err := src.ReadAt(p, off); err != nil {
						b.Fatal(err)
					}
				}
				src.Close()
				b.StopTimer()
				bc.Close()
				b.StartTimer()
			}
		})
	}
}
