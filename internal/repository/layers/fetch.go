package layers

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"os"

	"github.com/aenv-dev/aenv/internal/repository"
)

// FetchBlob copies blob digest (size bytes, when size > 0) into dst, an empty file, and
// verifies it on the way: chunk by chunk against the blob's published block hash list
// when Hashes knows one (a chunk reaches dst only once checked), else as a whole against
// its digest. All-zero chunks are not written, so dst stays sparse where the blob is
// zero (a guest's untouched RAM). On error dst holds a part of the blob: the caller
// removes it.
//
// It is for blobs a node needs whole as a local file, such as a microVM's memory image,
// which QEMU maps: they bypass the block cache, which would hold a second copy.
func (r *Resolver) FetchBlob(ctx context.Context, digest string, size int64, dst *os.File) error {
	d, err := repository.ParseDigest(digest)
	if err != nil {
		return fmt.Errorf("layers: %w", err)
	}
	lc, ok := r.Repo.(localCache)
	local := ok && lc.Cached(d)
	br, err := r.Repo.OpenBlob(ctx, d)
	if err != nil {
		return fmt.Errorf("layers: open %s: %w", d, err)
	}
	defer br.Close()
	n := br.Size()
	if size > 0 && n != size {
		return fmt.Errorf("%w: blob %s is %d bytes, its record says %d", repository.ErrDigestMismatch, d, n, size)
	}
	sums, err := r.sums(ctx, d, n)
	if err != nil {
		return err
	}
	chunk := int64(repository.DefaultBlockHashChunk)
	var whole *repository.Verifier
	if sums != nil {
		chunk = sums.Chunk
	} else {
		whole = repository.NewVerifier(d, n)
	}
	buf := make([]byte, chunk)
	for off := int64(0); off < n; off += chunk {
		if err := ctx.Err(); err != nil {
			return err
		}
		b := buf[:min(chunk, n-off)]
		got, err := br.ReadAt(ctx, b, off)
		if got == len(b) && errors.Is(err, io.EOF) {
			err = nil
		}
		if err == nil && got != len(b) {
			err = io.ErrUnexpectedEOF
		}
		if err != nil {
			return fmt.Errorf("layers: fetch %s at %d: %w", d, off, err)
		}
		if !local {
			r.fetched.Add(int64(got))
		}
		if sums != nil {
			if err := sums.Check(string(d), b, off); err != nil {
				r.badDirect.Add(1)
				slog.Error("layers: fetched data does not match its published hash", "digest", d, "offset", off, "err", err)
				return err
			}
		} else {
			_, _ = whole.Write(b)
		}
		if allZero(b) {
			continue
		}
		if _, err := dst.WriteAt(b, off); err != nil {
			return fmt.Errorf("layers: fetch %s: %w", d, err)
		}
	}
	if whole != nil {
		if err := whole.Check(); err != nil {
			return fmt.Errorf("layers: fetch %s: %w", d, err)
		}
	}
	if err := dst.Truncate(n); err != nil {
		return fmt.Errorf("layers: fetch %s: %w", d, err)
	}
	return nil
}

func allZero(b []byte) bool {
	for len(b) >= 8 {
		if b[0]|b[1]|b[2]|b[3]|b[4]|b[5]|b[6]|b[7] != 0 {
			return false
		}
		b = b[8:]
	}
	for _, c := range b {
		if c != 0 {
			return false
		}
	}
	return true
}
