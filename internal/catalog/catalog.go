// Package catalog is the node's embedded, pure-Go store (one bbolt file, usually
// <data-dir>/aenv.db): sandbox records, templates and snapshots, API keys and the
// node's persistent secrets.
//
// The catalog knows nothing about the orchestrator's types: sandbox records are stored
// as opaque bytes keyed by id, so the orchestrator can depend on the catalog without an
// import cycle. Templates and API keys are typed here because several packages (server,
// CLI, template builder) share them.
package catalog

import (
	"crypto/rand"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"time"

	bolt "go.etcd.io/bbolt"
	bolterrors "go.etcd.io/bbolt/errors"
)

// Sentinel errors callers branch on.
var (
	ErrNotFound   = errors.New("catalog: not found")
	ErrAliasTaken = errors.New("catalog: alias already in use")
	ErrInvalid    = errors.New("catalog: invalid record")
	ErrExists     = errors.New("catalog: already exists")
	// ErrLocked: another process holds the catalog (bbolt's exclusive file lock).
	ErrLocked = errors.New("catalog: locked by another process")
)

// Bucket names. Changing one orphans existing data, so they are fixed.
var (
	bucketMeta            = []byte("meta")
	bucketSandboxes       = []byte("sandboxes")
	bucketTemplates       = []byte("templates")
	bucketTemplateAliases = []byte("template_aliases")
	bucketAPIKeys         = []byte("apikeys")
	bucketAPIKeyHashes    = []byte("apikey_hashes")
)

// Catalog is an open store. It is safe for concurrent use; writes are serialized by
// bbolt and each one is durable (fsynced) when its method returns.
type Catalog struct {
	db        *bolt.DB
	sandboxes *Sandboxes
	templates *Templates
	apiKeys   *APIKeys
}

// Open opens (creating if needed) the store at path, creating the parent directory
// with mode 0700. A second process opening the same file fails after a short wait
// instead of blocking forever, because bbolt holds an exclusive file lock.
func Open(path string) (*Catalog, error) {
	if err := os.MkdirAll(filepath.Dir(path), 0o700); err != nil {
		return nil, fmt.Errorf("catalog: create directory: %w", err)
	}
	db, err := bolt.Open(path, 0o600, &bolt.Options{Timeout: 2 * time.Second})
	if errors.Is(err, bolterrors.ErrTimeout) {
		return nil, fmt.Errorf("%w: %s", ErrLocked, path)
	}
	if err != nil {
		return nil, fmt.Errorf("catalog: open %s: %w", path, err)
	}
	err = db.Update(func(tx *bolt.Tx) error {
		for _, b := range [][]byte{bucketMeta, bucketSandboxes, bucketTemplates,
			bucketTemplateAliases, bucketAPIKeys, bucketAPIKeyHashes} {
			if _, err := tx.CreateBucketIfNotExists(b); err != nil {
				return err
			}
		}
		return nil
	})
	if err != nil {
		db.Close()
		return nil, fmt.Errorf("catalog: init buckets: %w", err)
	}
	c := &Catalog{db: db}
	c.sandboxes = &Sandboxes{db: db, writes: &groupCommit{db: db}}
	c.templates = &Templates{db: db}
	c.apiKeys = &APIKeys{db: db}
	return c, nil
}

// Close releases the file. Using the catalog afterwards returns errors.
func (c *Catalog) Close() error {
	if err := c.db.Close(); err != nil {
		return fmt.Errorf("catalog: close: %w", err)
	}
	return nil
}

// Path is the file the catalog lives in.
func (c *Catalog) Path() string { return c.db.Path() }

// Sandboxes is the sandbox-record sub-store.
func (c *Catalog) Sandboxes() *Sandboxes { return c.sandboxes }

// Templates is the template and snapshot sub-store.
func (c *Catalog) Templates() *Templates { return c.templates }

// APIKeys is the API key sub-store.
func (c *Catalog) APIKeys() *APIKeys { return c.apiKeys }

// Secret returns the node secret called name, generating and persisting size random
// bytes the first time. It is how state that must survive a restart (for example the
// seed that envd access tokens are derived from) stays stable. A secret that exists
// with a different size is returned unchanged.
func (c *Catalog) Secret(name string, size int) ([]byte, error) {
	if name == "" || size <= 0 {
		return nil, fmt.Errorf("%w: secret name %q size %d", ErrInvalid, name, size)
	}
	key := []byte("secret/" + name)
	var out []byte
	err := c.db.View(func(tx *bolt.Tx) error {
		if v := tx.Bucket(bucketMeta).Get(key); v != nil {
			out = append([]byte(nil), v...)
		}
		return nil
	})
	if err != nil || out != nil {
		return out, wrap("read secret", err)
	}
	fresh := make([]byte, size)
	if _, err := rand.Read(fresh); err != nil {
		return nil, fmt.Errorf("catalog: generate secret: %w", err)
	}
	err = c.db.Update(func(tx *bolt.Tx) error {
		b := tx.Bucket(bucketMeta)
		// Another caller may have won the race between View and Update.
		if v := b.Get(key); v != nil {
			out = append([]byte(nil), v...)
			return nil
		}
		out = fresh
		return b.Put(key, fresh)
	})
	return out, wrap("write secret", err)
}

func wrap(what string, err error) error {
	if err == nil {
		return nil
	}
	return fmt.Errorf("catalog: %s: %w", what, err)
}
