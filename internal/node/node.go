// Package node assembles one aenv node from its configuration: the catalog and API keys,
// the repository with its caches, the sandbox backend chosen by backend.kind, the
// snapshot publisher, the orchestrator, the template builder and the HTTP handler of
// the E2B-compatible API. `aenv serve` is this package plus a listener; anything else
// that runs a node (tests, a gateway's local node) opens it the same way.
//
// # Backends
//
// The backend is looked up by backend.kind in a Backends registry (DefaultBackends, or
// Options.Backends). A factory gets a BackendEnv (the config, its own data directory,
// envd, the lazy layer resolver, metrics, a logger) and returns a Backend: the
// sandbox.Backend contract plus Close. The node never asserts a concrete backend type;
// the optional behaviours of the contract (sandbox.SnapshotDiscarder and the others)
// are found by the orchestrator on whatever the factory returned. A new kind is a
// factory and one line in DefaultBackends.
//
// # Order
//
// Open brings the parts up in dependency order and Close takes them down in reverse:
// the orchestrator publishes through the publisher, and the publisher's sync asks the
// orchestrator which entries are in use, so the publisher is made first, handed to the
// orchestrator, and only started (snapshot.Publisher.Start) with the orchestrator once
// that has reconciled the sandboxes of the previous run.
package node

import (
	"context"
	"crypto/x509"
	"fmt"
	"log/slog"
	"net/http"
	"os"
	"path/filepath"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"

	"github.com/aenv-dev/aenv/internal/apikey"
	"github.com/aenv-dev/aenv/internal/catalog"
	"github.com/aenv-dev/aenv/internal/config"
	"github.com/aenv-dev/aenv/internal/egressproxy"
	"github.com/aenv-dev/aenv/internal/orchestrator"
	"github.com/aenv-dev/aenv/internal/sandbox"
	"github.com/aenv-dev/aenv/internal/sandboxconn"
	"github.com/aenv-dev/aenv/internal/secret"
	"github.com/aenv-dev/aenv/internal/server"
	"github.com/aenv-dev/aenv/internal/snapshot"
	"github.com/aenv-dev/aenv/internal/steptime"
	"github.com/aenv-dev/aenv/internal/template/build"
	"github.com/aenv-dev/aenv/internal/volume"
)

// CatalogFile is the node's catalog inside its data directory.
const CatalogFile = "aenv.db"

// Options are what Open takes besides the config.
type Options struct {
	// Backends are the backend kinds to choose from (default DefaultBackends()).
	Backends Backends
	// Logger receives the node's logs (default slog.Default()).
	Logger *slog.Logger
}

// Node is one running node. Its parts are exported for the caller that serves it
// (Handler) and for tests; they are owned by the node and released by Close.
type Node struct {
	Config       config.Config
	Log          *slog.Logger
	Catalog      *catalog.Catalog
	Metrics      *prometheus.Registry
	Backend      Backend
	Publisher    *snapshot.Publisher
	Orchestrator *orchestrator.Orchestrator
	// Capacity is what the node can give its sandboxes (admission control).
	Capacity orchestrator.Capacity
	Builds   *build.Service
	// Volumes and Secrets are the node's volume and secret stores (under the data dir).
	Volumes *volume.Store
	Secrets *secret.Store
	// Handler serves the API, the envd proxy and /metrics.
	Handler http.Handler
	// MetricsHandler serves /metrics (with the metrics token) for a listener of its own.
	MetricsHandler http.Handler
	// APIKey says where the admin API key came from (for the operator's first start).
	APIKey apikey.Bootstrapped
	// P2P is the node's peer-to-peer layer distribution; nil when cluster.p2p is off.
	P2P *P2P

	// baseBuild is the node's own build of the base template, when one runs.
	baseBuild *baseBuild
	// egressCA is the egress proxy's CA, given to sandboxes with network.rules.
	egressCA *egressproxy.CA
	// sandboxConns are the connections into sandboxes, shared by the orchestrator (envd
	// /health, /init) and the proxy, so a create's /init connection carries the first command.
	sandboxConns sandboxconn.Pools
	// closers undo Open, in reverse order.
	closers []func(ctx context.Context)
}

// Open assembles the node for cfg (validated) and starts it: sandboxes of the previous
// run are reconciled, the publisher syncs, the base template exists. On error everything
// Open started is closed again.
func Open(ctx context.Context, cfg config.Config, o Options) (_ *Node, err error) {
	if o.Backends == nil {
		o.Backends = DefaultBackends()
	}
	if o.Logger == nil {
		o.Logger = slog.Default()
	}
	// Before anything is made: a node that cannot run its backend changes nothing.
	factory, err := o.Backends.factory(cfg.Backend.Kind)
	if err != nil {
		return nil, err
	}
	envd, err := findEnvd(cfg.Envd.Path)
	if err != nil {
		return nil, err
	}
	roots, err := upstreamRoots(cfg)
	if err != nil {
		return nil, err
	}
	n := &Node{Config: cfg, Log: o.Logger, Metrics: prometheus.NewRegistry(), baseBuild: newBaseBuild(o.Logger),
		sandboxConns: sandboxconn.New()}
	n.onClose(func(context.Context) { n.sandboxConns.CloseIdleConnections() })
	defer func() {
		if err != nil {
			n.Close(context.WithoutCancel(ctx))
		}
	}()
	n.Metrics.MustRegister(collectors.NewGoCollector(), collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}))
	// How long each step of the start took, logged once the node is open.
	laps := steptime.Start()
	lap := laps.Lap
	// Sandbox roots (in user namespaces) must traverse the data dir to their rootfs.
	if err := os.MkdirAll(cfg.DataDir, 0o711); err != nil {
		return nil, fmt.Errorf("create the data directory: %w", err)
	}
	if err := n.openCatalog(ctx); err != nil {
		return nil, err
	}
	lap("catalog")
	repo, err := openRepository(ctx, cfg, n.Metrics, n.Log)
	if err != nil {
		return nil, err
	}
	n.onClose(func(context.Context) { repo.Close() })
	if n.P2P, err = startP2P(cfg, repo, n.Metrics, n.Log); err != nil {
		return nil, err
	}
	if n.P2P != nil {
		n.onClose(n.P2P.Close)
	}

	lap("repository")
	if cfg.Backend.Kind == "oci" || cfg.Backend.Kind == "microvm" {
		// Before the data plane starts, so that it inherits the open-file limit.
		raiseHostLimits("/proc/sys", hostLimits, n.Log)
		raiseOpenFiles("/proc/sys", openFilesWant, n.Log)
	}
	var dp *nodeDataPlane
	// The oci and microvm backends open their root disks through the data plane.
	if cfg.Backend.DataPlane && (cfg.Backend.Kind == "oci" || cfg.Backend.Kind == "microvm") {
		if dp, err = startDataPlane(ctx, cfg, n.Log); err != nil {
			return nil, err
		}
		// After the backend's close (closers run in reverse), and also when Open fails
		// later (no runtime works, the egress CA cannot be made): a data plane left with
		// no disk (sandboxes stopped or paused, or none ever made) ends; one still serving
		// the disks of kept sandboxes runs on for the next node.
		n.onClose(func(ctx context.Context) {
			cctx, cancel := context.WithTimeout(ctx, 30*time.Second)
			defer cancel()
			dp.stopIfIdle(cctx)
		})
	}
	lap("data_plane")
	kind := cfg.Backend.Kind
	env := BackendEnv{Config: cfg, DataDir: filepath.Join(cfg.DataDir, kind), EnvdPath: envd,
		Layers: repo.layers, Registerer: n.Metrics, Logger: n.Log.With("component", kind)}
	if dp != nil {
		env.DataPlane = dp.Client
	}
	env.EgressUpstreamRoots = roots
	// The egress proxy's CA: made on the first start, kept under <data_dir>/egress.
	if env.EgressCA, err = egressproxy.LoadOrCreateCA(filepath.Join(cfg.DataDir, "egress")); err != nil {
		return nil, err
	}
	n.egressCA = env.EgressCA
	n.Backend, err = factory(ctx, env)
	if err != nil {
		return nil, err
	}
	lap("backend")
	n.onClose(func(ctx context.Context) {
		cctx, cancel := context.WithTimeout(ctx, 30*time.Second)
		defer cancel()
		if err := n.Backend.Close(cctx); err != nil {
			n.Log.Warn("close the sandbox backend", "backend", kind, "err", err)
		}
	})

	// The built-in templates and the sandboxes of the previous run do not depend on each
	// other. When the catalog already has both built-in templates installed (any
	// restart), the API does not wait for their check at all: creates use the installed
	// templates meanwhile, and the check (a walk of the base tree, ~0.15 s of CPU) runs
	// settleDelay after the node opened, so that it does not compete with adopting the
	// sandboxes and answering their first requests; it updates the templates only if
	// their tree changed while the node was down. On a first start both are checked at
	// once, and the API waits for the longer of the two.
	installed := builtinsInstalled(n.Catalog, cfg)
	var baseDone chan error
	if !installed {
		baseDone = make(chan error, 1)
		go func() { baseDone <- ensureBaseTemplates(ctx, n.Catalog, cfg, n.Log, n.baseBuild) }()
	}
	err = n.startSandboxes(ctx, repo)
	lap("sandboxes")
	if !installed {
		if berr := <-baseDone; err == nil {
			err = berr
		}
	}
	lap("templates")
	// First to stop on Close: a base build still running is cancelled and cleaned up.
	n.onClose(func(context.Context) { n.baseBuild.stop() })
	if installed {
		// Before the base build stops and the catalog closes.
		n.onClose(n.checkBaseLater(ctx))
	}
	if err != nil {
		return nil, err
	}
	if dp != nil {
		n.watchDataPlane(dp)
	}
	if err := n.openAPI(); err != nil {
		return nil, err
	}
	lap("api")
	n.Log.Info("node open", laps.Attrs()...)
	return n, nil
}

// settleDelay is how long a start's background work (the built-in templates' check, the
// template builder's garbage collection) waits after the node opened: a restart first
// adopts its sandboxes and answers their first requests, on a host whose CPUs the
// sandboxes share.
const settleDelay = 2 * time.Second

// checkBaseLater checks the installed built-in templates settleDelay from now, in the
// background. The returned func, for Close, ends the wait (the check then runs at the
// next start) or waits for a check in progress.
func (n *Node) checkBaseLater(ctx context.Context) func(context.Context) {
	stop, checked := make(chan struct{}), make(chan struct{})
	go func() {
		defer close(checked)
		t := time.NewTimer(settleDelay)
		defer t.Stop()
		select {
		case <-stop:
			return
		case <-ctx.Done():
			return
		case <-t.C:
		}
		if err := ensureBaseTemplates(ctx, n.Catalog, n.Config, n.Log, n.baseBuild); err != nil {
			n.Log.Error("check the built-in templates", "err", err)
		}
	}()
	return func(context.Context) {
		close(stop)
		<-checked
	}
}

// openCatalog opens the catalog and makes sure an admin API key exists.
func (n *Node) openCatalog(ctx context.Context) error {
	cat, err := openCatalog(ctx, n.Config.DataDir, filepath.Join(n.Config.DataDir, CatalogFile), n.Log)
	if err != nil {
		return fmt.Errorf("%w (is another `aenv serve` using %s?)", err, n.Config.DataDir)
	}
	n.Catalog = cat
	n.onClose(func(context.Context) { cat.Close() })
	n.APIKey, err = apikey.Bootstrap(ctx, cat.APIKeys(), n.Config.DataDir, n.Config.APIKey)
	return err
}

// startSandboxes makes the publisher and the orchestrator, reconciles the sandboxes the
// last run left, and starts publishing and syncing.
func (n *Node) startSandboxes(ctx context.Context, repo *nodeRepository) error {
	cfg := n.Config
	pub, err := openPublisher(cfg, n.Catalog, repo, n.Log)
	if err != nil {
		return err
	}
	n.Publisher = pub
	// The publisher closes after the orchestrator's shutdown (which unpins) and before
	// the backend and the catalog its sync writes to.
	n.onClose(func(context.Context) { pub.Close() })

	n.Capacity, err = orchestrator.HostCapacity(cfg.DataDir, cfg.Sandbox.CPUOvercommit, cfg.Sandbox.MemoryOvercommit)
	if err != nil {
		return err
	}
	if n.Volumes, err = volume.Open(filepath.Join(cfg.DataDir, "volumes"), volume.Options{SizeMB: cfg.Volumes.SizeMB}); err != nil {
		return err
	}
	if n.Secrets, err = secret.Open(filepath.Join(cfg.DataDir, "secrets")); err != nil {
		return err
	}
	n.Log.Info("sandbox capacity", "max_cpu_per_sandbox", n.Capacity.CPUCount, "memory_mb", n.Capacity.MemoryMB,
		"max_disk_mb_per_sandbox", n.Capacity.DiskSizeMB)
	n.Orchestrator, err = orchestrator.New(orchestrator.Config{
		DefaultTimeout: cfg.Sandbox.DefaultTimeout.Duration,
		MaxTimeout:     cfg.Sandbox.MaxTimeout.Duration,
		DefaultResources: sandbox.Resources{
			CPUCount: cfg.Sandbox.DefaultCPU, MemoryMB: cfg.Sandbox.DefaultMemoryMB, DiskSizeMB: cfg.Sandbox.DefaultDiskMB,
		},
		MaxSandboxes:     cfg.Sandbox.MaxSandboxes,
		Capacity:         n.Capacity,
		EnvdReadyTimeout: cfg.Envd.ReadyTimeout.Duration,
		EnvdVersion:      cfg.Envd.Version,
		ShutdownAction:   orchestrator.ShutdownAction(cfg.Sandbox.ShutdownAction),
		Registerer:       n.Metrics,
		Logger:           n.Log,
		TemplatePending:  n.baseBuild.pending,
		TemplateFetch:    pub.Fetch,
		EgressCA:         n.egressCA.CertPEM(),
	}, n.Backend, n.Catalog, orchestrator.WithPublisher(pub, repo.cache),
		orchestrator.WithVolumes(n.Volumes), orchestrator.WithSecrets(n.Secrets),
		orchestrator.WithEnvdClient(orchestrator.NewEnvdClient(n.sandboxConns)))
	if err != nil {
		return err
	}
	if err := n.Orchestrator.Start(ctx); err != nil {
		return fmt.Errorf("reconcile sandboxes: %w", err)
	}
	// A snapshot deleted on another node stays here while a sandbox of this node runs
	// on it (its layers are pinned meanwhile); once it leaves the catalog, the backend
	// frees its capture as for a local delete.
	if err := pub.Start(ctx, n.Orchestrator); err != nil {
		return fmt.Errorf("start the snapshot publisher: %w", err)
	}
	n.onClose(func(ctx context.Context) {
		sctx, cancel := context.WithTimeout(ctx, 2*time.Minute)
		defer cancel()
		if err := n.Orchestrator.Shutdown(sctx); err != nil {
			n.Log.Error("shutdown sandboxes", "err", err)
		}
	})
	return nil
}

// openAPI starts the template builder and makes the API handler.
func (n *Node) openAPI() error {
	cfg, cat, orch := n.Config, n.Catalog, n.Orchestrator
	// Builds run in sandboxes of this node; Close cancels running ones (they end in error).
	builds, err := build.New(build.Config{DataDir: cfg.DataDir, Publisher: n.Publisher, Logger: n.Log, Registerer: n.Metrics,
		StartupGCDelay: settleDelay},
		orch, cat.Templates())
	if err != nil {
		return fmt.Errorf("start the template builder: %w", err)
	}
	n.Builds = builds
	n.onClose(func(context.Context) { builds.Close() })

	// `aenv pull` goes through here while the node holds the catalog lock.
	pulls := &server.Puller{Templates: cat.Templates(), DataDir: cfg.DataDir,
		CanConvert: func() bool { return LayeredTemplate(cat, MinimalTemplateID) },
		Publisher:  n.Publisher, InUse: orch.UsesRootFSDir, Retired: builds.Retired, Capacity: n.Capacity, Log: n.Log}
	srv, err := server.New(server.Options{
		Orchestrator:     orch,
		Builds:           builds,
		Pulls:            pulls,
		Auth:             apikey.NewVerifier(cat.APIKeys()),
		Keys:             cat.APIKeys(),
		Volumes:          n.Volumes,
		NodeName:         nodeName(cfg),
		Secrets:          n.Secrets,
		Domains:          cfg.Proxy.Domains,
		Registry:         n.Metrics,
		MetricsToken:     cfg.MetricsToken,
		MetricsElsewhere: cfg.MetricsListen != "",
		DefaultTimeout:   cfg.Sandbox.DefaultTimeout.Duration,
		DefaultTimeoutV1: cfg.Sandbox.DefaultTimeoutV1.Duration,
		MaxTimeout:       cfg.Sandbox.MaxTimeout.Duration,
		Capacity:         n.Capacity,
		Logger:           n.Log,
		Transport:        n.sandboxConns,
	})
	if err != nil {
		return err
	}
	n.Handler, n.MetricsHandler = srv, srv.MetricsHandler()
	return nil
}

func (n *Node) onClose(f func(ctx context.Context)) { n.closers = append(n.closers, f) }

// Close stops the node in the reverse order of Open: builds, sandboxes (as
// sandbox.shutdown_action says), publisher, backend, repository, catalog. Each step has
// its own deadline, so a canceled ctx still shuts down cleanly. Close is idempotent.
func (n *Node) Close(ctx context.Context) {
	ctx = context.WithoutCancel(ctx)
	for i := len(n.closers) - 1; i >= 0; i-- {
		n.closers[i](ctx)
	}
	n.closers = nil
}

// upstreamRoots is what the egress proxy verifies servers against when
// network.egress_upstream_ca is set: the system's roots plus that file's (nil: the system's).
func upstreamRoots(cfg config.Config) (*x509.CertPool, error) {
	if cfg.Network.EgressUpstreamCA == "" {
		return nil, nil
	}
	pem, err := os.ReadFile(cfg.Network.EgressUpstreamCA)
	if err != nil {
		return nil, fmt.Errorf("network.egress_upstream_ca: %w", err)
	}
	roots, err := x509.SystemCertPool()
	if err != nil {
		roots = x509.NewCertPool()
	}
	if !roots.AppendCertsFromPEM(pem) {
		return nil, fmt.Errorf("network.egress_upstream_ca: %s holds no PEM certificate", cfg.Network.EgressUpstreamCA)
	}
	return roots, nil
}

// nodeName is how the node names itself to API clients: its cluster id, else the host name.
func nodeName(cfg config.Config) string {
	if cfg.Cluster.NodeID != "" {
		return cfg.Cluster.NodeID
	}
	h, _ := os.Hostname()
	return h
}
