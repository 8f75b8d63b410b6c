package node

import (
	"context"
	"encoding/hex"
	"fmt"
	"log/slog"
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/aenv-dev/aenv/internal/catalog"
	"github.com/aenv-dev/aenv/internal/config"
	"github.com/aenv-dev/aenv/internal/repository"
	"github.com/aenv-dev/aenv/internal/repository/layers"
	"github.com/aenv-dev/aenv/internal/repository/nodecache"
	"github.com/aenv-dev/aenv/internal/snapshot"
	"github.com/aenv-dev/aenv/internal/storage/cache"
)

// nodeRepository is this node's access to the shared repository: the whole-blob node
// cache in front of it (publication, pins, GC; it holds the layers this node published),
// and the lazy path the oci backend opens synced layers through (ranges read from the
// repository through the block cache, never a whole-blob fetch).
type nodeRepository struct {
	cache  *nodecache.Cache
	remote repository.Repository
	blocks *cache.Cache
	layers *layers.Resolver

	stop context.CancelFunc
	wg   sync.WaitGroup
}

// openRepository opens the repository ([snapshot] repository_backend), the node cache
// and the block cache ([repository.block_cache]), registers their metrics on reg and
// starts keeping the blobs this node reads lazily alive in the repository (see
// layers.Resolver.KeepAlive). Close stops that.
func openRepository(ctx context.Context, cfg config.Config, reg prometheus.Registerer, log *slog.Logger) (*nodeRepository, error) {
	nc, remote, err := snapshot.OpenRepositories(ctx, cfg)
	if err != nil {
		return nil, fmt.Errorf("open the snapshot repository: %w", err)
	}
	bc := cfg.Repository.BlockCache
	blocks, err := cache.Open(cache.Options{Dir: cfg.BlockCacheDir(), MaxBytes: int64(bc.MaxSizeGB) << 30,
		BlockSize: int64(bc.BlockSizeKB) << 10, Readahead: bc.Readahead, HighWater: bc.HighWatermark, LowWater: bc.LowWatermark})
	if err != nil {
		return nil, fmt.Errorf("open the block cache: %w", err)
	}
	r := &nodeRepository{cache: nc, remote: remote, blocks: blocks,
		layers: &layers.Resolver{Repo: nc, Cache: blocks, Remote: remote}}
	if err := r.register(reg); err != nil {
		blocks.Close()
		return nil, err
	}
	kctx, cancel := context.WithCancel(context.WithoutCancel(ctx))
	r.stop = cancel
	r.wg.Go(func() { r.keepAlive(kctx, keepAliveEvery(cfg.Snapshot.GCGrace.Duration), log) })
	return r, nil
}

// keepAliveEvery is the period of KeepAlive: well inside GC's grace period, so a blob
// read here is never older than the grace when another node collects.
func keepAliveEvery(grace time.Duration) time.Duration {
	if grace <= 0 {
		grace = repository.DefaultGrace
	}
	return min(max(grace/4, 10*time.Second), 5*time.Minute)
}

func (r *nodeRepository) keepAlive(ctx context.Context, every time.Duration, log *slog.Logger) {
	t := time.NewTicker(every)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
		// Pins cover paused sandboxes, whose layers are not open.
		if n, err := r.layers.KeepAlive(ctx, r.cache.Pinned()); err != nil && ctx.Err() == nil {
			log.Warn("keep lazily read layers alive in the repository", "refreshed", n, "err", err)
		}
	}
}

// Close stops the keep-alive and waits for it and for the block cache's prefetches.
func (r *nodeRepository) Close() error {
	r.stop()
	r.wg.Wait()
	r.layers.Wait()
	return r.blocks.Close()
}

// register exposes the bytes fetched from the repository and the block cache's counters.
func (r *nodeRepository) register(reg prometheus.Registerer) error {
	counter := func(name, help string, f func() float64) prometheus.Collector {
		return prometheus.NewCounterFunc(prometheus.CounterOpts{Name: name, Help: help}, f)
	}
	bs := func(f func(cache.Stats) int64) func() float64 {
		return func() float64 { return float64(f(r.blocks.Stats())) }
	}
	for _, c := range []prometheus.Collector{
		counter("aenv_repository_fetched_bytes_total",
			"Bytes read from the shared repository: ranges of lazily read layers plus whole blobs fetched into the node cache.",
			func() float64 { return float64(r.layers.FetchedBytes() + r.cache.Stats().FetchedBytes) }),
		counter("aenv_repository_verify_failures_total",
			"Chunks of lazily read layers that did not match their published block hash (a corrupt or tampered blob); each failed the read.",
			func() float64 { return float64(r.layers.VerifyFailures()) }),
		counter("aenv_block_cache_hits_total", "Block cache reads served from cached blocks.",
			bs(func(s cache.Stats) int64 { return s.Hits })),
		counter("aenv_block_cache_misses_total", "Block cache reads that fetched their block from the repository.",
			bs(func(s cache.Stats) int64 { return s.Misses })),
		counter("aenv_block_cache_fetched_bytes_total", "Bytes the block cache fetched (misses and readahead).",
			bs(func(s cache.Stats) int64 { return s.FetchedBytes })),
		counter("aenv_block_cache_evictions_total", "Blocks evicted from the block cache.",
			bs(func(s cache.Stats) int64 { return s.Evictions })),
		prometheus.NewGaugeFunc(prometheus.GaugeOpts{Name: "aenv_block_cache_used_bytes", Help: "Bytes the block cache holds on disk."},
			func() float64 { return float64(r.blocks.Stats().UsedBytes) }),
	} {
		if err := reg.Register(c); err != nil {
			return fmt.Errorf("register repository metrics: %w", err)
		}
	}
	return nil
}

// openPublisher makes the publisher that publishes this node's snapshots and templates
// to the repository (through the node cache) and syncs the catalog from it. Its sync
// asks the orchestrator which entries are in use, which it is given at Start.
//
// The node id, which the publisher writes into every record it publishes (only the
// publishing node may resume a pending record), is a random id made on first start and
// kept in the catalog: stable across restarts, unique per data directory, and unlike
// the host name never shared by two nodes on one host.
func openPublisher(cfg config.Config, cat *catalog.Catalog, repo *nodeRepository, log *slog.Logger) (*snapshot.Publisher, error) {
	secret, err := cat.Secret("node-id", 16)
	if err != nil {
		return nil, fmt.Errorf("node id: %w", err)
	}
	nodeID := hex.EncodeToString(secret)
	o := snapshot.ConfigOptions(cfg, nodeID)
	o.Logger = log.With("component", "snapshot")
	pub, err := snapshot.New(repo.cache, cat.Templates(), o)
	if err != nil {
		return nil, fmt.Errorf("start the snapshot publisher: %w", err)
	}
	// Lazily read layers are verified against the block hash lists their
	// records name, which the publisher learns as it syncs them. Set before
	// the orchestrator starts, so before any layer is opened.
	repo.layers.Hashes = pub.HashIndex()
	log.Info("snapshot repository", "backend", cfg.Snapshot.RepositoryBackend, "node_id", nodeID,
		"sync_interval", o.SyncInterval, "lazy_layers", o.LazyLayers)
	return pub, nil
}
