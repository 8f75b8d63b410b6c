package layers

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"sync"
	"sync/atomic"

	"github.com/aenv-dev/aenv/internal/repository"
	"github.com/aenv-dev/aenv/internal/storage/cache"
)

// verifiedDirect reads a remote layer without a block cache (compaction
// reads whole layers this way) and verifies what it reads: whole chunks,
// the last one kept, so sequential reads of less than a chunk fetch it once.
type verifiedDirect struct {
	blob     repository.BlobReader
	d        repository.Digest
	sums     *cache.Sums
	failures *atomic.Int64

	mu    sync.Mutex
	chunk int64 // index of buf's chunk, -1 for none
	buf   []byte
}

func (v *verifiedDirect) Size() int64  { return v.blob.Size() }
func (v *verifiedDirect) Close() error { return v.blob.Close() }

func (v *verifiedDirect) ReadAt(p []byte, off int64) (int, error) {
	size := v.blob.Size()
	if off < 0 {
		return 0, fmt.Errorf("layers: %s: negative offset", v.d)
	}
	if off >= size {
		return 0, io.EOF
	}
	v.mu.Lock()
	defer v.mu.Unlock()
	ch := v.sums.Chunk
	done := 0
	for done < len(p) && off+int64(done) < size {
		pos := off + int64(done)
		if err := v.load(pos / ch); err != nil {
			return done, err
		}
		done += copy(p[done:], v.buf[pos-v.chunk*ch:])
	}
	if done < len(p) {
		return done, io.EOF
	}
	return done, nil
}

// load reads and verifies chunk j into v.buf.
func (v *verifiedDirect) load(j int64) error {
	if v.chunk == j && v.buf != nil {
		return nil
	}
	ch := v.sums.Chunk
	n := min(ch, v.blob.Size()-j*ch)
	if int64(cap(v.buf)) < n {
		v.buf = make([]byte, ch)
	}
	v.buf, v.chunk = v.buf[:n], -1
	got, err := v.blob.ReadAt(context.Background(), v.buf, j*ch)
	if int64(got) != n {
		if err == nil || errors.Is(err, io.EOF) {
			err = io.ErrUnexpectedEOF
		}
		return fmt.Errorf("layers: %s: read chunk %d: %w", v.d, j, err)
	}
	if err := v.sums.Check(string(v.d), v.buf, j*ch); err != nil {
		v.failures.Add(1)
		slog.Error("layers: lazily read data does not match its published hash; the read fails", "digest", v.d, "chunk", j, "err", err)
		return err
	}
	v.chunk = j
	return nil
}
