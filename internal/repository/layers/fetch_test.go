package layers

import (
	"bytes"
	"context"
	"errors"
	"os"
	"syscall"
	"testing"

	"github.com/aenv-dev/aenv/internal/repository"
	"github.com/aenv-dev/aenv/internal/repository/posixfs"
	"github.com/aenv-dev/aenv/internal/storage/cache"
)

// TestFetchBlob: a blob fetched whole arrives intact and sparse where it is zero; a
// corrupted byte fails the fetch, against the chunk's published hash when the record has
// a block hash list and against the digest when it has none; a wrong size is refused.
func TestFetchBlob(t *testing.T) {
	ctx := context.Background()
	const chunk = 256 << 10
	// Half zero (an untouched guest RAM region), half data, not a whole number of chunks.
	data := make([]byte, 4<<20+1234)
	for i := 2 << 20; i < len(data); i++ {
		data[i] = byte(i*7 + i>>9)
	}
	d := repository.DigestOf(data)
	for _, tc := range []struct {
		name    string
		hashes  bool
		corrupt bool
		size    int64
		want    error
	}{
		{name: "with block hashes", hashes: true, size: int64(len(data))},
		{name: "without block hashes", size: 0},
		{name: "corrupt, block hashes", hashes: true, corrupt: true, want: cache.ErrVerify},
		{name: "corrupt, digest only", corrupt: true, want: repository.ErrDigestMismatch},
		{name: "wrong size", hashes: true, size: 4096, want: repository.ErrDigestMismatch},
	} {
		t.Run(tc.name, func(t *testing.T) {
			dir := t.TempDir()
			repo, err := posixfs.Open(dir, posixfs.Options{})
			if err != nil {
				t.Fatal(err)
			}
			r := &Resolver{Repo: repo}
			if tc.hashes {
				store := &HashStore{Dir: t.TempDir()}
				if err := store.Learn(ctx, repo, publishWithHashes(t, repo, data, d, chunk)); err != nil {
					t.Fatal(err)
				}
				r.Hashes = store
			} else if _, err := repo.PutBlob(ctx, d, int64(len(data)), bytes.NewReader(data)); err != nil {
				t.Fatal(err)
			}
			if tc.corrupt {
				corruptByte(t, dir, d, 3<<20+5)
			}
			f, err := os.Create(t.TempDir() + "/blob")
			if err != nil {
				t.Fatal(err)
			}
			defer f.Close()
			err = r.FetchBlob(ctx, string(d), tc.size, f)
			if tc.want != nil {
				if !errors.Is(err, tc.want) {
					t.Fatalf("FetchBlob = %v, want %v", err, tc.want)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			got, err := os.ReadFile(f.Name())
			if err != nil {
				t.Fatal(err)
			}
			if !bytes.Equal(got, data) {
				t.Fatal("fetched bytes differ")
			}
			var st syscall.Stat_t
			if err := syscall.Stat(f.Name(), &st); err != nil {
				t.Fatal(err)
			}
			if allocated := st.Blocks * 512; allocated >= int64(len(data))-1<<20 {
				t.Fatalf("fetched file allocates %d bytes of %d: zero chunks were written", allocated, len(data))
			}
		})
	}
	if err := (&Resolver{}).FetchBlob(ctx, "sha256:nope", 0, nil); !errors.Is(err, repository.ErrInvalid) {
		t.Fatalf("bad digest: %v", err)
	}
}
