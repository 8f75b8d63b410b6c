package snapshot

import (
	"context"
	"fmt"
	"log/slog"
	"path/filepath"

	"github.com/aenv-dev/aenv/internal/config"
	"github.com/aenv-dev/aenv/internal/repository"
	"github.com/aenv-dev/aenv/internal/repository/nodecache"
	"github.com/aenv-dev/aenv/internal/repository/posixfs"
	"github.com/aenv-dev/aenv/internal/repository/s3"
)

// OpenRepository opens the configured repository backend
// ([snapshot] repository_backend) and the node cache in front of it. The
// returned repository is the cache (use it for everything); the cache is
// also returned for its pins and stats. The posix_fs directory is created
// when missing; an S3 bucket must exist.
func OpenRepository(ctx context.Context, cfg config.Config) (repository.Repository, *nodecache.Cache, error) {
	cache, _, err := OpenRepositories(ctx, cfg)
	if err != nil {
		return nil, nil, err
	}
	return cache, cache, nil
}

// OpenRepositories is OpenRepository that also returns the repository behind
// the node cache (for what must reach it directly: keeping lazily read blobs
// alive).
func OpenRepositories(ctx context.Context, cfg config.Config) (*nodecache.Cache, repository.Repository, error) {
	log := slog.Default()
	var remote repository.Repository
	switch cfg.Snapshot.RepositoryBackend {
	case "posix_fs":
		r, err := posixfs.Open(cfg.RepositoryPath(), posixfs.Options{})
		if err != nil {
			return nil, nil, fmt.Errorf("snapshot: posix_fs repository %s: %w", cfg.RepositoryPath(), err)
		}
		remote = r
	case "s3":
		sc := cfg.Repository.S3
		addr := s3.Addressing(sc.Addressing)
		if sc.Addressing == "auto" {
			addr = s3.AddressAuto
		}
		r, err := s3.Open(ctx, s3.Config{Endpoint: sc.Endpoint, Bucket: sc.Bucket, Prefix: sc.Prefix, Region: sc.Region,
			Addressing: addr, AccessKey: sc.AccessKey, SecretKey: sc.SecretKey, Logger: log})
		if err != nil {
			return nil, nil, fmt.Errorf("snapshot: s3 repository %s/%s: %w", sc.Endpoint, sc.Bucket, err)
		}
		remote = r
	default:
		return nil, nil, fmt.Errorf("%w: repository_backend %q", ErrInvalid, cfg.Snapshot.RepositoryBackend)
	}
	cc := cfg.Repository.Cache
	cache, err := nodecache.Open(ctx, remote, nodecache.Options{Dir: cfg.RepositoryCacheDir(), MaxBytes: int64(cc.MaxSizeGB) << 30,
		HighWater: cc.HighWatermark, LowWater: cc.LowWatermark, Logger: log})
	if err != nil {
		return nil, nil, fmt.Errorf("snapshot: node cache %s: %w", cfg.RepositoryCacheDir(), err)
	}
	return cache, remote, nil
}

// ConfigOptions are the publisher options the node config sets; the caller
// adds Logger (and hands the node's users to Start).
func ConfigOptions(cfg config.Config, nodeID string) Options {
	return Options{
		NodeID:       nodeID,
		StateDir:     filepath.Join(cfg.DataDir, "snapshot"),
		Workers:      cfg.Snapshot.PublishWorkers,
		MaxDepth:     cfg.Snapshot.MaxDepth,
		SyncInterval: cfg.Snapshot.SyncInterval.Duration,
		GCGrace:      cfg.Snapshot.GCGrace.Duration,
		LazyLayers:   cfg.Snapshot.LazyLayers,
	}
}
