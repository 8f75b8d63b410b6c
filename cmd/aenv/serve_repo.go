package main

import (
	"context"
	"encoding/hex"
	"fmt"
	"log/slog"

	"github.com/aenv-dev/aenv/internal/catalog"
	"github.com/aenv-dev/aenv/internal/config"
	"github.com/aenv-dev/aenv/internal/orchestrator"
	"github.com/aenv-dev/aenv/internal/repository/nodecache"
	"github.com/aenv-dev/aenv/internal/snapshot"
)

// openPublisher opens the snapshot repository ([snapshot] repository_backend, with the
// node cache in front) and the publisher that publishes this node's snapshots and
// templates to it and syncs the catalog from it. orch returns the node's orchestrator;
// it is called only once the publisher runs (after Start), when it is set.
//
// The node id, which the publisher writes into every record it publishes (only the
// publishing node may resume a pending record), is a random id made on first start and
// kept in the catalog: stable across restarts, unique per data directory, and unlike
// the host name never shared by two nodes on one host.
func openPublisher(ctx context.Context, cfg config.Config, cat *catalog.Catalog, log *slog.Logger,
	orch func() *orchestrator.Orchestrator) (*snapshot.Publisher, *nodecache.Cache, error) {
	secret, err := cat.Secret("node-id", 16)
	if err != nil {
		return nil, nil, fmt.Errorf("node id: %w", err)
	}
	nodeID := hex.EncodeToString(secret)
	repo, cache, err := snapshot.OpenRepository(ctx, cfg)
	if err != nil {
		return nil, nil, fmt.Errorf("open the snapshot repository: %w", err)
	}
	o := snapshot.ConfigOptions(cfg, nodeID)
	o.Logger = log.With("component", "snapshot")
	// A snapshot deleted on another node stays here while a sandbox of this node runs
	// on it (its layers are pinned meanwhile) ...
	o.InUse = func(id string) bool { return orch().UsesTemplate(id) }
	// ... and once it leaves the catalog, the backend frees its capture as for a
	// local delete.
	o.OnRemoved = func(ctx context.Context, t catalog.Template) { orch().DiscardTemplate(ctx, t) }
	pub, err := snapshot.New(repo, cat.Templates(), o)
	if err != nil {
		return nil, nil, fmt.Errorf("start the snapshot publisher: %w", err)
	}
	log.Info("snapshot repository", "backend", cfg.Snapshot.RepositoryBackend, "node_id", nodeID,
		"sync_interval", o.SyncInterval)
	return pub, cache, nil
}
