package cache

import (
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"log/slog"
)

// ErrVerify marks fetched bytes that do not match the source's published
// block hashes: the source is corrupt or was tampered with. Nothing of the
// chunk is cached, and the read fails (an I/O error to a sandbox) rather
// than return bytes nobody published.
var ErrVerify = errors.New("cache: fetched block does not match its published hash")

// Sums are the published SHA-256 sums of a source, one per Chunk bytes (the
// last chunk may be short). Chunk is a power of two; when it is smaller
// than the cache's block size each block is checked chunk by chunk, when it
// is larger a miss fetches the whole chunk so it can be checked.
type Sums struct {
	Chunk int64
	Sums  [][sha256.Size]byte
}

// FileVerified is File for a source whose blocks are verified against sums
// before they are cached or returned. Its blocks are cached apart from an
// unverified File of the same key, so blocks cached before the sums were
// known are never trusted.
func (c *Cache) FileVerified(key string, src Source, sums *Sums) (*File, error) {
	size := src.Size()
	switch {
	case sums == nil:
		return nil, fmt.Errorf("cache %s: no sums", key)
	case sums.Chunk < pageSize || sums.Chunk&(sums.Chunk-1) != 0:
		return nil, fmt.Errorf("cache %s: sum chunk %d not a power of two ≥ %d", key, sums.Chunk, pageSize)
	case int64(len(sums.Sums)) != (size+sums.Chunk-1)/sums.Chunk:
		return nil, fmt.Errorf("%w: %s: %d sums for %d bytes at %d per chunk", ErrVerify, key, len(sums.Sums), size, sums.Chunk)
	}
	h := sha256.Sum256([]byte(key + "\x00verified"))
	return &File{c: c, key: key, dir: hex.EncodeToString(h[:16]), src: src, size: size, sums: sums, last: -2}, nil
}

// verify checks buf, the source's bytes at off (chunk-aligned, whole
// chunks but maybe the last), against f.sums.
func (f *File) verify(buf []byte, off int64) error {
	if f.sums == nil {
		return nil
	}
	if err := f.sums.Check(f.key, buf, off); err != nil {
		f.c.verifyFailures.Add(1)
		slog.Error("cache: lazily fetched data does not match its published hash; the read fails, nothing is cached",
			"key", f.key, "offset", off, "err", err)
		return err
	}
	return nil
}

// Check verifies buf, the bytes of source key at off (chunk-aligned, whole
// chunks but maybe the last), against s; a mismatch is an error wrapping
// ErrVerify that names the first bad chunk.
func (s *Sums) Check(key string, buf []byte, off int64) error {
	ch := s.Chunk
	for i := int64(0); i < int64(len(buf)); i += ch {
		j := (off + i) / ch
		end := min(i+ch, int64(len(buf)))
		if got := sha256.Sum256(buf[i:end]); got != s.Sums[j] {
			return fmt.Errorf("%w: %s chunk %d (bytes %d..%d): sha256 %x, published %x", ErrVerify, key, j,
				off+i, off+end, got, s.Sums[j])
		}
	}
	return nil
}
