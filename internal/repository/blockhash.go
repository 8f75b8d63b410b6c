package repository

import (
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/binary"
	"fmt"
	"io"
)

// A block hash list is the SHA-256 of each fixed-size chunk of one blob. It
// is published as a blob of its own (content-addressed, named by the
// record's Layer.BlockHashes), so that a node reading the blob lazily, in
// ranges, can verify every chunk it fetches: the blob's digest can only be
// checked by reading all of it. The record is trusted, the list is checked
// against the digest the record names, and each chunk against the list.
//
// Encoding: magic "aenvbh01" | u64 LE blob size | u64 LE chunk size |
// 32-byte SHA-256 per chunk, ceil(size/chunk) of them (the last chunk may be
// short). A 1 GiB blob at 1 MiB chunks needs 32 KiB.

const blockHashMagic = "aenvbh01"

// Chunk sizes a list may use: powers of two, so a chunk and a block cache
// block (also a power of two) always nest one in the other.
const (
	MinBlockHashChunk     = 4 << 10
	MaxBlockHashChunk     = 64 << 20
	DefaultBlockHashChunk = 1 << 20 // the block cache's default block size
)

// maxBlockHashBytes bounds a list read from a repository (a 1 TiB blob at
// 1 MiB chunks), so a corrupt or hostile list cannot exhaust memory.
const maxBlockHashBytes = 24 + 32<<20

// BlockHashes is a decoded block hash list.
type BlockHashes struct {
	Size  int64 // the blob's size
	Chunk int64 // bytes per chunk, a power of two
	Sums  [][sha256.Size]byte
}

func validChunk(c int64) bool {
	return c >= MinBlockHashChunk && c <= MaxBlockHashChunk && c&(c-1) == 0
}

// ComputeBlockHashes reads r to its end and hashes it in chunks of chunk
// bytes. Hash the blob's digest in the same pass with an io.TeeReader.
func ComputeBlockHashes(r io.Reader, chunk int64) (*BlockHashes, error) {
	if !validChunk(chunk) {
		return nil, errorf(ErrInvalid, "block hash chunk %d: want a power of two in %d..%d", chunk, MinBlockHashChunk, MaxBlockHashChunk)
	}
	h := &BlockHashes{Chunk: chunk}
	buf := make([]byte, chunk)
	for {
		n, err := io.ReadFull(r, buf)
		if n > 0 {
			h.Sums = append(h.Sums, sha256.Sum256(buf[:n]))
			h.Size += int64(n)
		}
		if err == io.EOF || err == io.ErrUnexpectedEOF {
			return h, nil
		}
		if err != nil {
			return nil, fmt.Errorf("block hashes: %w", err)
		}
	}
}

// Encode serializes h.
func (h *BlockHashes) Encode() []byte {
	b := make([]byte, 0, 24+len(h.Sums)*sha256.Size)
	b = append(b, blockHashMagic...)
	b = binary.LittleEndian.AppendUint64(b, uint64(h.Size))
	b = binary.LittleEndian.AppendUint64(b, uint64(h.Chunk))
	for _, s := range h.Sums {
		b = append(b, s[:]...)
	}
	return b
}

// Digest is the digest of h's encoding, the name it is published under.
func (h *BlockHashes) Digest() Digest { return DigestOf(h.Encode()) }

// DecodeBlockHashes parses an encoded list; anything malformed is ErrInvalid.
func DecodeBlockHashes(b []byte) (*BlockHashes, error) {
	if len(b) < 24 || !bytes.Equal(b[:8], []byte(blockHashMagic)) {
		return nil, errorf(ErrInvalid, "block hash list: bad header")
	}
	if len(b) > maxBlockHashBytes {
		return nil, errorf(ErrInvalid, "block hash list of %d bytes exceeds %d", len(b), maxBlockHashBytes)
	}
	size := binary.LittleEndian.Uint64(b[8:])
	chunk := int64(binary.LittleEndian.Uint64(b[16:]))
	if !validChunk(chunk) || size > 1<<62 {
		return nil, errorf(ErrInvalid, "block hash list: size %d chunk %d", size, chunk)
	}
	n := (int64(size) + chunk - 1) / chunk
	if int64(len(b)-24) != n*sha256.Size {
		return nil, errorf(ErrInvalid, "block hash list: %d bytes of sums for %d chunks", len(b)-24, n)
	}
	h := &BlockHashes{Size: int64(size), Chunk: chunk, Sums: make([][sha256.Size]byte, n)}
	for i := range h.Sums {
		copy(h.Sums[i][:], b[24+i*sha256.Size:])
	}
	return h, nil
}

// ReadBlockHashes fetches the list d names and checks it against d and the
// blob size it describes.
func ReadBlockHashes(ctx context.Context, repo Repository, d Digest, size int64) (*BlockHashes, error) {
	if err := d.Validate(); err != nil {
		return nil, err
	}
	// A ranged read, not GetBlob: a node cache in front of repo would keep
	// a copy of every list, which nothing needs once it is decoded.
	br, err := repo.OpenBlob(ctx, d)
	if err != nil {
		return nil, fmt.Errorf("block hash list %s: %w", d, err)
	}
	defer br.Close()
	if br.Size() > maxBlockHashBytes {
		return nil, errorf(ErrInvalid, "block hash list %s of %d bytes exceeds %d", d, br.Size(), maxBlockHashBytes)
	}
	b := make([]byte, br.Size())
	if n, err := br.ReadAt(ctx, b, 0); n != len(b) {
		return nil, fmt.Errorf("block hash list %s: read %d of %d bytes: %w", d, n, len(b), err)
	}
	if got := DigestOf(b); got != d {
		return nil, errorf(ErrDigestMismatch, "block hash list %s: stored bytes hash to %s", d, got)
	}
	h, err := DecodeBlockHashes(b)
	if err != nil {
		return nil, fmt.Errorf("block hash list %s: %w", d, err)
	}
	if size >= 0 && h.Size != size {
		return nil, errorf(ErrDigestMismatch, "block hash list %s describes %d bytes, the blob has %d", d, h.Size, size)
	}
	return h, nil
}
