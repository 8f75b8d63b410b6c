package main

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"net/http/pprof"
	"os"
	"os/exec"
	"path/filepath"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"
	"github.com/spf13/cobra"

	"github.com/aenv-dev/aenv/internal/apikey"
	"github.com/aenv-dev/aenv/internal/catalog"
	"github.com/aenv-dev/aenv/internal/config"
	"github.com/aenv-dev/aenv/internal/network"
	"github.com/aenv-dev/aenv/internal/orchestrator"
	"github.com/aenv-dev/aenv/internal/rootfs"
	"github.com/aenv-dev/aenv/internal/sandbox"
	"github.com/aenv-dev/aenv/internal/sandbox/oci"
	"github.com/aenv-dev/aenv/internal/server"
	"github.com/aenv-dev/aenv/internal/template/base"
	"github.com/aenv-dev/aenv/internal/template/build"
	"github.com/aenv-dev/aenv/internal/template/layered"
)

// baseTemplateID is the template the SDKs create from by default.
const baseTemplateID = "base"

func newServeCmd() *cobra.Command {
	var (
		configPath string
		listen     string
		dataDir    string
		envdPath   string
		baseRootFS string
	)
	cmd := &cobra.Command{
		Use:   "serve",
		Short: "Run a node: the E2B-compatible API, the sandbox proxy and the sandboxes",
		Long: "serve runs a single-node aenv: sandboxes on this machine, the E2B-compatible API and\n" +
			"the proxy that carries SDK traffic into sandboxes, all on one listener (--listen).\n" +
			"Configuration: embedded defaults < --config FILE < AENV_* variables < flags\n" +
			"(see docs/configuration.md). Point the E2B SDKs at it with\n" +
			"  E2B_API_URL=http://127.0.0.1:8000 E2B_SANDBOX_URL=http://127.0.0.1:8000 E2B_API_KEY=<key>",
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			cfg, err := config.Load(configPath, os.LookupEnv)
			if err != nil {
				return err
			}
			f := cmd.Flags()
			if f.Changed("listen") {
				cfg.Listen = listen
			}
			if f.Changed("data-dir") {
				cfg.DataDir = dataDir
			}
			if f.Changed("envd") {
				cfg.Envd.Path = envdPath
			}
			if f.Changed("base-rootfs") {
				cfg.Templates.BaseRootFS = baseRootFS
			}
			if err := cfg.Validate(); err != nil {
				return err
			}
			return serve(cmd.Context(), cfg)
		},
	}
	f := cmd.Flags()
	f.StringVar(&configPath, "config", os.Getenv("AENV_CONFIG"), "TOML config file (default $AENV_CONFIG; none: embedded defaults)")
	f.StringVar(&listen, "listen", config.Default().Listen, "address of the API and sandbox proxy")
	f.StringVar(&dataDir, "data-dir", config.Default().DataDir, "directory for all node state")
	f.StringVar(&envdPath, "envd", "", "envd binary to run in sandboxes (default: envd next to this binary)")
	f.StringVar(&baseRootFS, "base-rootfs", "", "prebuilt base rootfs directory to install as the base template on first start")
	return cmd
}

func newLogger(cfg config.Config) *slog.Logger {
	var level slog.Level
	_ = level.UnmarshalText([]byte(cfg.LogLevel))
	opts := &slog.HandlerOptions{Level: level}
	if cfg.LogFormat == "json" {
		return slog.New(slog.NewJSONHandler(os.Stderr, opts))
	}
	return slog.New(slog.NewTextHandler(os.Stderr, opts))
}

// serve runs the node until ctx ends (SIGINT/SIGTERM), then shuts down gracefully.
func serve(ctx context.Context, cfg config.Config) error {
	log := newLogger(cfg)
	slog.SetDefault(log)
	// Sandbox roots (in user namespaces) must traverse the data dir to their rootfs.
	if err := os.MkdirAll(cfg.DataDir, 0o711); err != nil {
		return fmt.Errorf("create the data directory: %w", err)
	}
	// The catalog first: a predecessor killed half-way (a zombie still holding the port and
	// the catalog) is cleared there, and only then is the port bound.
	cat, err := openCatalog(ctx, cfg.DataDir, filepath.Join(cfg.DataDir, catalogFile), log)
	if err != nil {
		return fmt.Errorf("%w (is another `aenv serve` using %s?)", err, cfg.DataDir)
	}
	defer cat.Close()
	// Bind before anything is started, so a port conflict fails early.
	ln, err := listen(ctx, cfg.Listen)
	if err != nil {
		return fmt.Errorf("listen on %s: %w (set --listen or AENV_LISTEN)", cfg.Listen, err)
	}
	defer ln.Close()
	if cfg.DebugListen != "" {
		stop, err := serveDebug(cfg.DebugListen, log)
		if err != nil {
			return err
		}
		defer stop()
	}

	boot, err := apikey.Bootstrap(ctx, cat.APIKeys(), cfg.DataDir, cfg.APIKey)
	if err != nil {
		return err
	}
	switch {
	case boot.Explicit:
		log.Info("API key from AENV_API_KEY is active")
		if !apikey.E2BCompatible(cfg.APIKey) {
			log.Warn("AENV_API_KEY is not e2b_ + lowercase hex: the E2B Python SDK rejects it unless E2B_VALIDATE_API_KEY=false")
		}
	case boot.Created:
		fmt.Fprintf(os.Stderr, "aenv: generated the admin API key; it is in %s (export E2B_API_KEY=$(cat %[1]s))\n", boot.Path)
	case boot.Path != "":
		fmt.Fprintf(os.Stderr, "aenv: the admin API key is in %s\n", boot.Path)
	}

	envd, err := findEnvd(cfg.Envd.Path)
	if err != nil {
		return err
	}
	reg := prometheus.NewRegistry()
	reg.MustRegister(collectors.NewGoCollector(), collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}))

	repo, err := openRepository(ctx, cfg, reg, log)
	if err != nil {
		return err
	}
	defer repo.Close()

	var dp *nodeDataPlane
	var dpc oci.DataPlane
	if cfg.Backend.DataPlane {
		if dp, err = startDataPlane(ctx, cfg, log); err != nil {
			return err
		}
		dpc = dp.Client
	}
	backend, err := oci.New(ctx, oci.Config{
		DataDir:         filepath.Join(cfg.DataDir, "oci"),
		EnvdPath:        envd,
		Runtime:         cfg.Backend.Runtime,
		Logger:          log.With("component", "oci"),
		CgroupParent:    cfg.Backend.CgroupParent,
		SnapshotQuiesce: cfg.Snapshot.Quiesce,
		LayerResolver:   repo.layers,
		DataPlane:       dpc,
		Network: network.Config{
			Bridge:   cfg.Network.Bridge,
			Subnet:   cfg.Network.Subnet,
			Prefix:   cfg.Network.Prefix,
			PoolSize: cfg.Network.PoolSize,
		},
	})
	if err != nil {
		if errors.Is(err, oci.ErrNoRuntime) {
			return fmt.Errorf("no OCI runtime can start a container on this host: %w "+
				"(install runc: `apt-get install runc`, run as root, or choose one with backend.runtime / AENV_BACKEND_RUNTIME)", err)
		}
		return fmt.Errorf("start the oci backend: %w", err)
	}
	defer func() {
		cctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 30*time.Second)
		defer cancel()
		if err := backend.Close(cctx); err != nil {
			log.Warn("close the oci backend", "err", err)
		}
		if dp != nil {
			dp.stopIfIdle(cctx)
		}
	}()

	// The publisher closes after the orchestrator's shutdown (which unpins) and before
	// the backend and the catalog its sync writes to.
	var orch *orchestrator.Orchestrator
	pub, pins, err := openPublisher(cfg, cat, repo, log, func() *orchestrator.Orchestrator { return orch })
	if err != nil {
		return err
	}
	defer pub.Close()

	orch, err = orchestrator.New(orchestrator.Config{
		DefaultTimeout: cfg.Sandbox.DefaultTimeout.Duration,
		MaxTimeout:     cfg.Sandbox.MaxTimeout.Duration,
		DefaultResources: sandbox.Resources{
			CPUCount: cfg.Sandbox.DefaultCPU, MemoryMB: cfg.Sandbox.DefaultMemoryMB, DiskSizeMB: cfg.Sandbox.DefaultDiskMB,
		},
		MaxSandboxes:     cfg.Sandbox.MaxSandboxes,
		EnvdReadyTimeout: cfg.Envd.ReadyTimeout.Duration,
		EnvdVersion:      cfg.Envd.Version,
		ShutdownAction:   orchestrator.ShutdownAction(cfg.Sandbox.ShutdownAction),
		Registerer:       reg,
		Logger:           log,
	}, backend, cat, orchestrator.WithTemplateRootFS(rootfs.TemplateRootFS), orchestrator.WithPublisher(pub, pins))
	if err != nil {
		return err
	}
	if err := orch.Start(ctx); err != nil {
		return fmt.Errorf("reconcile sandboxes: %w", err)
	}
	if dp != nil {
		wctx, stopWatch := context.WithCancel(ctx)
		defer stopWatch()
		go dp.watch(wctx, backend.OnDataPlane, func(ids []string) {
			lctx := context.WithoutCancel(wctx)
			if err := backend.DataPlaneLost(lctx); err != nil {
				log.Warn("drop warm containers on layered roots", "err", err)
			}
			orch.DropLost(lctx, ids, "data plane died")
		})
	}
	if err := pub.Start(ctx); err != nil {
		return fmt.Errorf("start the snapshot publisher: %w", err)
	}
	defer func() {
		sctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 2*time.Minute)
		defer cancel()
		if err := orch.Shutdown(sctx); err != nil {
			log.Error("shutdown sandboxes", "err", err)
		}
	}()

	if err := ensureBaseTemplate(ctx, cat, cfg, log); err != nil {
		return err
	}

	// Builds run in sandboxes of this node; Close cancels running ones (they end in error).
	builds, err := build.New(build.Config{DataDir: cfg.DataDir, Publisher: pub, Logger: log, Registerer: reg}, orch, cat.Templates())
	if err != nil {
		return fmt.Errorf("start the template builder: %w", err)
	}
	defer builds.Close()

	// `aenv pull` goes through here while the node holds the catalog lock.
	pulls := &server.Puller{Templates: cat.Templates(), DataDir: cfg.DataDir,
		CanConvert: func() bool { return layeredTemplate(cat, baseTemplateID) },
		Publisher:  pub, InUse: orch.UsesRootFSDir, Retired: builds.Retired, Log: log}
	srv, err := server.New(server.Options{
		Orchestrator:     orch,
		Builds:           builds,
		Pulls:            pulls,
		Auth:             apikey.NewVerifier(cat.APIKeys()),
		Keys:             cat.APIKeys(),
		Domains:          cfg.Proxy.Domains,
		Registry:         reg,
		DefaultTimeout:   cfg.Sandbox.DefaultTimeout.Duration,
		DefaultTimeoutV1: cfg.Sandbox.DefaultTimeoutV1.Duration,
		MaxTimeout:       cfg.Sandbox.MaxTimeout.Duration,
		Logger:           log,
	})
	if err != nil {
		return err
	}
	httpSrv := &http.Server{
		Handler: srv,
		// No read/write timeouts: envd streams (background commands, PTYs) live for hours.
		ReadHeaderTimeout: 10 * time.Second,
		IdleTimeout:       2 * time.Minute,
		ErrorLog:          slog.NewLogLogger(log.Handler(), slog.LevelDebug),
	}
	errc := make(chan error, 1)
	go func() { errc <- httpSrv.Serve(ln) }()
	log.Info("aenv serving", "listen", ln.Addr().String(), "data_dir", cfg.DataDir, "runtime", backend.Runtime(),
		"userns", backend.UserNamespaces())
	fmt.Fprintf(os.Stderr, "aenv: serving on http://%s\n", ln.Addr())
	if tcp, ok := ln.Addr().(*net.TCPAddr); ok && !tcp.IP.IsLoopback() {
		log.Warn("the API is reachable from the network over plain HTTP; put a TLS-terminating proxy in front", "listen", ln.Addr().String())
	}

	select {
	case err := <-errc:
		return fmt.Errorf("serve HTTP: %w", err)
	case <-ctx.Done():
	}
	log.Info("shutting down", "sandboxes", cfg.Sandbox.ShutdownAction)
	sctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 15*time.Second)
	defer cancel()
	// Shutdown waits for requests in flight; long-lived streams are cut at the deadline.
	if err := httpSrv.Shutdown(sctx); err != nil {
		httpSrv.Close()
	}
	return nil
}

// serveDebug serves net/http/pprof on addr until stop is called. It uses its own mux, not
// http.DefaultServeMux, so the profiles never leak onto the API listener.
func serveDebug(addr string, log *slog.Logger) (stop func(), err error) {
	ln, err := net.Listen("tcp", addr)
	if err != nil {
		return nil, fmt.Errorf("listen on %s: %w (set debug_listen or AENV_DEBUG_LISTEN)", addr, err)
	}
	mux := http.NewServeMux()
	mux.HandleFunc("/debug/pprof/", pprof.Index)
	mux.HandleFunc("/debug/pprof/cmdline", pprof.Cmdline)
	mux.HandleFunc("/debug/pprof/profile", pprof.Profile)
	mux.HandleFunc("/debug/pprof/symbol", pprof.Symbol)
	mux.HandleFunc("/debug/pprof/trace", pprof.Trace)
	srv := &http.Server{Handler: mux, ReadHeaderTimeout: 10 * time.Second}
	go func() {
		if err := srv.Serve(ln); err != nil && !errors.Is(err, http.ErrServerClosed) {
			log.Warn("debug listener stopped", "err", err)
		}
	}()
	log.Info("pprof debug listener", "listen", ln.Addr().String())
	if tcp, ok := ln.Addr().(*net.TCPAddr); ok && !tcp.IP.IsLoopback() {
		log.Warn("the pprof debug listener is reachable from the network; profiles reveal memory contents", "listen", ln.Addr().String())
	}
	return func() { srv.Close() }, nil
}

// findEnvd resolves the envd binary: the configured path, else "envd" next to aenv.
func findEnvd(path string) (string, error) {
	if path == "" {
		exe, err := os.Executable()
		if err != nil {
			return "", fmt.Errorf("locate envd: %w (pass --envd)", err)
		}
		path = filepath.Join(filepath.Dir(exe), "envd")
	}
	abs, err := filepath.Abs(path)
	if err != nil {
		return "", err
	}
	fi, err := os.Stat(abs)
	if err != nil || fi.IsDir() || fi.Mode()&0o111 == 0 {
		return "", fmt.Errorf("envd binary %s is missing or not executable (build it with `make binaries`, or pass --envd / set AENV_ENVD_PATH)", abs)
	}
	return abs, nil
}

// ensureBaseTemplate makes sure the "base" template exists, so Sandbox.create() with the
// SDK's default template works on a fresh node: it installs the prebuilt rootfs given by
// templates.base_rootfs (copied into the data dir, so the node does not depend on a build
// tree) or builds one from the host's static binaries. It then makes the layered form of
// that rootfs (one sealed ext4 layer), so base sandboxes run on block roots that can be
// snapshotted, forked and paused to disk; where that cannot be made (no mkfs.ext4) base
// stays a directory template and those operations answer 501.
func ensureBaseTemplate(ctx context.Context, cat *catalog.Catalog, cfg config.Config, log *slog.Logger) error {
	dir := filepath.Join(cfg.DataDir, "templates", baseTemplateID, "rootfs")
	t, err := cat.Templates().Get(baseTemplateID)
	switch {
	case err == nil && base.Built(t.RootFSDir):
		dir = t.RootFSDir
	case err == nil || errors.Is(err, catalog.ErrNotFound):
		if err == nil {
			// Missing, or built by an older aenv: sandboxes already running keep the old
			// tree's inodes, new ones get the new build.
			log.Warn("base template's rootfs is missing or outdated; reinstalling it", "dir", t.RootFSDir)
		}
		if err := installBaseRootFS(ctx, cfg, dir, log); err != nil {
			return err
		}
	default:
		return fmt.Errorf("look up the base template: %w", err)
	}
	var art json.RawMessage
	if cfg.Templates.LayeredBase {
		art = layeredBase(ctx, cfg, dir, log)
	}
	if t.RootFSDir == dir && bytes.Equal(t.Artifact, art) {
		return nil
	}
	if err := cat.Templates().Put(catalog.Template{
		ID:             baseTemplateID,
		Kind:           catalog.KindTemplate,
		RootFSDir:      dir,
		DefaultUser:    "user",
		DefaultWorkdir: "/home/user",
		Artifact:       art,
		CreatedAt:      t.CreatedAt,
	}); err != nil {
		return fmt.Errorf("register the base template: %w", err)
	}
	log.Info("base template ready", "dir", dir, "layered", art != nil)
	return nil
}

// installBaseRootFS puts a finished base rootfs at dir.
func installBaseRootFS(ctx context.Context, cfg config.Config, dir string, log *slog.Logger) error {
	if src := cfg.Templates.BaseRootFS; src != "" {
		if !base.Built(src) {
			return fmt.Errorf("--base-rootfs %s is not a finished base build (run `aenv template build-base --out %[1]s`)", src)
		}
		if err := copyTree(ctx, src, dir); err != nil {
			return fmt.Errorf("install the base rootfs from %s: %w", src, err)
		}
		return nil
	}
	log.Info("building the base template", "dir", dir)
	if err := base.Build(ctx, base.Options{Out: dir}); err != nil {
		return fmt.Errorf("build the base template: %w (or pass --base-rootfs)", err)
	}
	return nil
}

// layeredBase returns the base template's layered artifact (made once per rootfs version
// and disk size, and checked to mount through FUSE and a loop device on this host), or
// nil, with a warning, where it cannot be made or used.
func layeredBase(ctx context.Context, cfg config.Config, dir string, log *slog.Logger) json.RawMessage {
	out := filepath.Join(cfg.DataDir, "templates", baseTemplateID, "layered")
	res, err := layered.Build(ctx, dir, out, cfg.Sandbox.DefaultDiskMB)
	if err == nil {
		err = layered.Verify(ctx, res.Manifest, filepath.Join(out, ".verify"))
	}
	if err != nil {
		log.Warn("base template stays a directory template: snapshot, fork and pause to disk of its sandboxes are unavailable",
			"err", err)
		return nil
	}
	if res.Built {
		log.Info("built the layered base template", "dir", out, "elapsed", res.Elapsed.Round(time.Millisecond))
	}
	return res.Artifact
}

// copyTree copies src to dst with `cp -a` (ownership, modes, links and devices as they
// are), through a temporary sibling so dst is either complete or absent.
func copyTree(ctx context.Context, src, dst string) error {
	if err := os.MkdirAll(filepath.Dir(dst), 0o755); err != nil {
		return err
	}
	tmp := dst + ".tmp"
	if err := os.RemoveAll(tmp); err != nil {
		return err
	}
	if out, err := exec.CommandContext(ctx, "cp", "-a", src, tmp).CombinedOutput(); err != nil {
		os.RemoveAll(tmp)
		return fmt.Errorf("cp -a: %w: %s", err, out)
	}
	if err := os.RemoveAll(dst); err != nil {
		return err
	}
	return os.Rename(tmp, dst)
}

// layeredTemplate reports whether template id runs on layered block roots, which is
// what makes converting pulled images worth its cost on this node.
func layeredTemplate(cat *catalog.Catalog, id string) bool {
	t, err := cat.Templates().Get(id)
	if err != nil {
		return false
	}
	var a struct {
		Overlaybd *struct {
			Layers []json.RawMessage `json:"layers"`
		} `json:"overlaybd"`
	}
	return json.Unmarshal(t.Artifact, &a) == nil && a.Overlaybd != nil && len(a.Overlaybd.Layers) > 0
}
