package microvm

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"sync"

	"github.com/aenv-dev/aenv/internal/atomicfile"
	"github.com/aenv-dev/aenv/internal/repository"
)

// BlobFetcher copies a repository blob into a local file, verifying every byte
// (*layers.Resolver): how a node gets the memory image of a capture made elsewhere.
type BlobFetcher interface {
	FetchBlob(ctx context.Context, digest string, size int64, dst *os.File) error
}

// fetchedDir holds memory-image blobs fetched from the repository, by digest. A copy is
// complete (renamed into place after its last chunk was verified and synced) and
// read-only; forks map it private, resumes copy it.
func (c *Config) fetchedDir() string { return filepath.Join(c.DataDir, "memory") }

// fetchedPath is where blob digest is kept once fetched; "" for no (valid) digest.
func (b *Backend) fetchedPath(digest string) string {
	d, err := repository.ParseDigest(digest)
	if err != nil {
		return ""
	}
	return filepath.Join(b.cfg.fetchedDir(), d.Hex())
}

// keyedMutex serialises work per key (one fetch of a blob at a time; forks restoring
// from the same capture wait for the first one's copy).
type keyedMutex struct {
	mu    sync.Mutex
	locks map[string]*keyedLock
}

type keyedLock struct {
	sync.Mutex
	users int
}

func (k *keyedMutex) lock(key string) func() {
	k.mu.Lock()
	if k.locks == nil {
		k.locks = map[string]*keyedLock{}
	}
	l := k.locks[key]
	if l == nil {
		l = &keyedLock{}
		k.locks[key] = l
	}
	l.users++
	k.mu.Unlock()
	l.Lock()
	return func() {
		l.Unlock()
		k.mu.Lock()
		if l.users--; l.users == 0 {
			delete(k.locks, key)
		}
		k.mu.Unlock()
	}
}

// localBlob returns a file on this node with mb's bytes: the capture's own file, or a
// verified copy fetched from the repository by digest.
func (b *Backend) localBlob(ctx context.Context, id string, mb *memBlob) (string, error) {
	if mb.Path != "" {
		if _, err := os.Stat(mb.Path); err == nil || mb.Digest == "" {
			return mb.Path, err
		}
		// Gone (a reboot took a transient image): the repository still has it.
	}
	path := b.fetchedPath(mb.Digest)
	if path == "" {
		return "", fmt.Errorf("microvm: capture %s: %s blob has no file here and no digest", id, mb.Role)
	}
	unlock := b.fetching.lock(path)
	defer unlock()
	if _, err := os.Stat(path); err == nil {
		return path, nil
	}
	if b.cfg.BlobFetcher == nil {
		return "", fmt.Errorf("microvm: capture %s: its %s blob %s is in the repository and this node has no repository to fetch it from",
			id, mb.Role, mb.Digest)
	}
	if err := os.MkdirAll(b.cfg.fetchedDir(), 0o700); err != nil {
		return "", fmt.Errorf("microvm: %w", err)
	}
	err := atomicfile.Fill(path, ".fetch-", 0o444, func(f *os.File) error {
		return b.cfg.BlobFetcher.FetchBlob(ctx, mb.Digest, mb.Size, f)
	})
	if err != nil {
		return "", fmt.Errorf("microvm: capture %s: fetch its %s blob from the repository: %w", id, mb.Role, err)
	}
	return path, nil
}

// localImage makes c's memory image local: the paths of its RAM file ("" for a full
// stream) and its state stream.
func (b *Backend) localImage(ctx context.Context, c *capture) (ram, state string, err error) {
	m := c.Memory
	if m.RAM != nil {
		if ram, err = b.localBlob(ctx, c.ID, m.RAM); err != nil {
			return "", "", err
		}
	}
	if state, err = b.localBlob(ctx, c.ID, &m.State); err != nil {
		return "", "", err
	}
	return ram, state, nil
}

// sweepFetchTemps removes the partial fetches a crash left.
func (b *Backend) sweepFetchTemps() error {
	ents, err := os.ReadDir(b.cfg.fetchedDir())
	if errors.Is(err, os.ErrNotExist) {
		return nil
	}
	if err != nil {
		return fmt.Errorf("microvm: %w", err)
	}
	var errs []error
	for _, e := range ents {
		if len(e.Name()) > 7 && e.Name()[:7] == ".fetch-" {
			errs = append(errs, removeFile(filepath.Join(b.cfg.fetchedDir(), e.Name())))
		}
	}
	return errors.Join(errs...)
}
