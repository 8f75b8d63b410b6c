package snapshot

import (
	"bytes"
	"context"
	"errors"
	"path/filepath"
	"testing"
	"time"

	"github.com/aenv-dev/aenv/internal/catalog"
	"github.com/aenv-dev/aenv/internal/config"
	"github.com/aenv-dev/aenv/internal/repository"
	"github.com/aenv-dev/aenv/internal/repository/s3/s3test"
)

// OpenRepository builds what the config names; a blob put through it lands
// in the configured place and in the node cache.
func TestOpenRepository(t *testing.T) {
	ctx := context.Background()
	for _, tc := range []struct {
		name string
		set  func(t *testing.T, c *config.Config)
	}{
		{"posix_fs default path", func(t *testing.T, c *config.Config) {}},
		{"s3", func(t *testing.T, c *config.Config) {
			srv := s3test.Start(t)
			c.Snapshot.RepositoryBackend = "s3"
			c.Repository.S3.Endpoint, c.Repository.S3.Bucket = srv.Endpoint, srv.Bucket(t)
			c.Repository.S3.Addressing = "path"
			c.Repository.S3.AccessKey, c.Repository.S3.SecretKey = s3test.AccessKey, s3test.SecretKey
		}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			c := config.Default()
			c.DataDir = t.TempDir()
			tc.set(t, &c)
			if err := c.Validate(); err != nil {
				t.Fatal(err)
			}
			repo, cache, err := OpenRepository(ctx, c)
			if err != nil {
				t.Fatal(err)
			}
			body := []byte("layer bytes")
			d := repository.DigestOf(body)
			if _, err := repo.PutBlob(ctx, d, int64(len(body)), bytes.NewReader(body)); err != nil {
				t.Fatal(err)
			}
			if !cache.Cached(d) {
				t.Fatal("blob not cached")
			}
			if c.Snapshot.RepositoryBackend == "posix_fs" {
				if got := c.RepositoryPath(); got != filepath.Join(c.DataDir, "repository") {
					t.Fatalf("repository path %s", got)
				}
			}
			o := ConfigOptions(c, "node-1")
			if o.StateDir != filepath.Join(c.DataDir, "snapshot") || o.MaxDepth != 32 || o.Workers != 4 {
				t.Fatalf("options %+v", o)
			}
		})
	}
	c := config.Default()
	c.DataDir = t.TempDir()
	c.Snapshot.RepositoryBackend = "s3"
	c.Repository.S3.Endpoint, c.Repository.S3.Bucket = "http://127.0.0.1:1", "nobucket"
	c.Repository.S3.AccessKey, c.Repository.S3.SecretKey = "k", "s"
	if _, _, err := OpenRepository(ctx, c); err == nil {
		t.Fatal("opened an unreachable S3 repository")
	}
}

// Started publishers sync on their own: node B's catalog gains node A's
// snapshot without an explicit Sync.
func TestBackgroundSync(t *testing.T) {
	ctx := context.Background()
	remote := posixBackend().open(t)
	a := newNode(t, "node-a", remote, Options{})
	nb := newNode(t, "node-b", remote, Options{SyncInterval: 20 * time.Millisecond})
	if err := nb.pub.Start(ctx, nil); err != nil {
		t.Fatal(err)
	}
	files, _ := stackLayers(t, t.TempDir(), 1, 9)
	publishWait(t, a, testManifest(t, "snap-bg", files))
	waitFor(t, "background sync", func() bool {
		_, err := nb.cat.Templates().Get("snap-bg")
		return err == nil
	})
	nb.pub.Close()
	if _, err := nb.pub.Publish(ctx, testManifest(t, "snap-late", files)); !errors.Is(err, ErrClosed) {
		t.Fatalf("Publish after Close: %v", err)
	}
	var _ CatalogStore = (*catalog.Templates)(nil)
}
