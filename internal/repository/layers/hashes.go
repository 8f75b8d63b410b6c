package layers

import (
	"context"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"sync"

	"github.com/aenv-dev/aenv/internal/atomicfile"
	"github.com/aenv-dev/aenv/internal/repository"
	"github.com/aenv-dev/aenv/internal/storage/cache"
)

// HashIndex finds the block hash list published for a layer, which lets
// the Resolver verify every range it fetches lazily.
type HashIndex interface {
	// BlockHashes returns d's list, or nil (and no error) when none is
	// known: the layer was published before lists existed.
	BlockHashes(ctx context.Context, d repository.Digest) (*repository.BlockHashes, error)
}

// HashStore is a HashIndex on local disk: one file per layer digest holding
// the encoded list. The publisher fills it when it publishes a layer
// (computed from the file) and when it syncs a record that names a list
// (fetched and checked against the record's digest); the node's data
// directory is trusted like its block cache. A restart fetches nothing.
//
// A write goes through a temporary file named tempPrefix + random in Dir; a
// crash mid-write leaves it there, and the owner of Dir removes such files
// when it opens (the publisher's sweep of its state).
type HashStore struct {
	Dir string

	mu sync.Mutex // serializes writes of one node's publisher and syncs
}

var _ HashIndex = (*HashStore)(nil)

func (s *HashStore) path(d repository.Digest) string { return filepath.Join(s.Dir, d.Hex()+".bh") }

// Encoded returns the stored encoding of d's list (to upload it) or
// fs.ErrNotExist.
func (s *HashStore) Encoded(d repository.Digest) ([]byte, error) {
	if err := d.Validate(); err != nil {
		return nil, err
	}
	return os.ReadFile(s.path(d))
}

// BlockHashes implements HashIndex.
func (s *HashStore) BlockHashes(_ context.Context, d repository.Digest) (*repository.BlockHashes, error) {
	b, err := s.Encoded(d)
	if errors.Is(err, fs.ErrNotExist) {
		return nil, nil
	}
	if err != nil {
		return nil, fmt.Errorf("layers: block hashes of %s: %w", d, err)
	}
	h, err := repository.DecodeBlockHashes(b)
	if err != nil {
		return nil, fmt.Errorf("layers: stored block hashes of %s: %w", d, err)
	}
	return h, nil
}

// ListDigest implements listNamer: the digest d's list is published under.
func (s *HashStore) ListDigest(d repository.Digest) (repository.Digest, bool) {
	b, err := s.Encoded(d)
	if err != nil {
		return "", false
	}
	return repository.DigestOf(b), true
}

// tempPrefix starts the names of Put's temporary files: a dot, which the publisher's
// startup sweep of its state removes.
const tempPrefix = ".tmp-"

// Put stores h as layer d's list and returns the digest it is published
// under.
func (s *HashStore) Put(d repository.Digest, h *repository.BlockHashes) (repository.Digest, error) {
	if err := d.Validate(); err != nil {
		return "", err
	}
	b := h.Encode()
	s.mu.Lock()
	defer s.mu.Unlock()
	if err := os.MkdirAll(s.Dir, 0o755); err != nil {
		return "", fmt.Errorf("layers: %w", err)
	}
	err := atomicfile.Fill(s.path(d), tempPrefix, 0o644, func(f *os.File) error {
		_, err := f.Write(b)
		return err
	})
	if err != nil {
		return "", fmt.Errorf("layers: store block hashes of %s: %w", d, err)
	}
	return repository.DigestOf(b), nil
}

// Learn makes sure the store holds the list l names (nothing to do when l
// names none), fetching it from repo and checking it against the digest and
// l's size.
func (s *HashStore) Learn(ctx context.Context, repo repository.Repository, l repository.Layer) error {
	if l.BlockHashes == "" {
		return nil
	}
	if b, err := s.Encoded(l.Digest); err == nil && repository.DigestOf(b) == l.BlockHashes {
		return nil
	}
	h, err := repository.ReadBlockHashes(ctx, repo, l.BlockHashes, l.Size)
	if err != nil {
		return fmt.Errorf("layers: layer %s: %w", l.Digest, err)
	}
	_, err = s.Put(l.Digest, h)
	return err
}

// sumsFor checks h against the blob it describes and converts it for the
// block cache.
func sumsFor(d repository.Digest, size int64, h *repository.BlockHashes) (*cache.Sums, error) {
	if h.Size != size {
		return nil, fmt.Errorf("%w: block hash list of %s describes %d bytes, the blob has %d",
			repository.ErrDigestMismatch, d, h.Size, size)
	}
	return &cache.Sums{Chunk: h.Chunk, Sums: h.Sums}, nil
}
