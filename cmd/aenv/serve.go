package main

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"net/http/pprof"
	"os"
	"runtime"
	"runtime/debug"
	"time"

	"github.com/spf13/cobra"

	"github.com/aenv-dev/aenv/internal/apikey"
	"github.com/aenv-dev/aenv/internal/config"
	"github.com/aenv-dev/aenv/internal/dataplane"
	"github.com/aenv-dev/aenv/internal/lazygc"
	"github.com/aenv-dev/aenv/internal/node"
)

func newServeCmd() *cobra.Command {
	var (
		configPath string
		listen     string
		dataDir    string
		envdPath   string
		baseRootFS string
		scheduler  string
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
			if f.Changed("scheduler") {
				cfg.Cluster.Scheduler = scheduler
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
	f.StringVar(&scheduler, "scheduler", "", "join a cluster: the scheduler's gRPC address (cluster.scheduler; default: a lone node)")
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
	// Without backend.data_plane the node serves the disks itself.
	debug.SetMaxThreads(dataplane.MaxThreads)
	// Bind before anything is started, so a port conflict fails early; but only once a
	// predecessor killed half-way (a zombie still holding the port and the catalog) has
	// been cleared.
	if err := node.ClearStaleHolder(ctx, cfg.DataDir, log); err != nil {
		return err
	}
	ln, err := node.Listen(ctx, cfg.Listen)
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

	gcBack := openingGC()
	n, err := node.Open(ctx, cfg, node.Options{Logger: log})
	servingGC(gcBack)
	if err != nil {
		return err
	}
	defer n.Close(ctx)
	announceAPIKey(n.APIKey, cfg, log)
	if cfg.MetricsListen != "" {
		stop, err := serveMetrics(cfg.MetricsListen, n.MetricsHandler, cfg.MetricsToken != "", log)
		if err != nil {
			return err
		}
		defer stop()
	}

	httpSrv := &http.Server{
		Handler: n.Handler,
		// No read/write timeouts: envd streams (background commands, PTYs) live for hours.
		ReadHeaderTimeout: 10 * time.Second,
		IdleTimeout:       2 * time.Minute,
		ErrorLog:          slog.NewLogLogger(log.Handler(), slog.LevelDebug),
	}
	errc := make(chan error, 1)
	go func() { errc <- httpSrv.Serve(ln) }()
	leave, err := joinCluster(ctx, cfg, ln.Addr(), n, log)
	if err != nil {
		httpSrv.Close()
		return err
	}
	defer leave()
	log.Info("aenv serving", "listen", ln.Addr().String(), "data_dir", cfg.DataDir, "backend", n.Backend.Name())
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

// openingHeap is the heap below which no garbage is collected while the node opens.
const openingHeap = 256 << 20

// openingGC makes the garbage collector wait for openingHeap (or the operator's lower
// GOMEMLIMIT) while the node opens: a restart that adopts hundreds of sandboxes grows its
// heap from nothing, which with the default settings is a collection every few MB, CPU
// taken from the adoption on a host whose CPUs the sandboxes share. The returned func puts
// the settings back.
func openingGC() (restore func()) {
	limit := debug.SetMemoryLimit(-1) // reads it
	pct := debug.SetGCPercent(-1)
	debug.SetMemoryLimit(min(limit, openingHeap))
	return func() {
		debug.SetMemoryLimit(limit)
		debug.SetGCPercent(pct)
	}
}

// servingGCFloor is the Go runtime memory below which a serving node collects no garbage.
const servingGCFloor = 32 << 20

// servingGC sets the collector of the serving node: lazygc with servingGCFloor, unless the
// operator set GOGC or GOMEMLIMIT, whose settings restore (openingGC's) puts back. The
// node's live heap is a few MiB (3 MiB around a fork of 16), so Go's default collector
// ran every few MiB of allocation: two cycles per fork of 16 with its kills, 0.7 ms of
// CPU per child, on the CPUs the sandboxes share; one every three forks with the floor,
// for ~13 MiB more resident. A node whose live heap passes a quarter of the floor (one
// holding many sandboxes) gets Go's default collector back.
func servingGC(restore func()) {
	if os.Getenv("GOGC") != "" || os.Getenv("GOMEMLIMIT") != "" {
		restore()
		return
	}
	lazygc.New(servingGCFloor)
}

// announceAPIKey tells the operator where the admin API key is.
func announceAPIKey(boot apikey.Bootstrapped, cfg config.Config, log *slog.Logger) {
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
}

// serveMetrics serves /metrics (only) on a listener of its own until stop is called.
func serveMetrics(addr string, h http.Handler, token bool, log *slog.Logger) (stop func(), err error) {
	ln, err := net.Listen("tcp", addr)
	if err != nil {
		return nil, fmt.Errorf("listen on %s: %w (set metrics_listen or AENV_METRICS_LISTEN)", addr, err)
	}
	mux := http.NewServeMux()
	mux.Handle("GET /metrics", h)
	srv := &http.Server{Handler: mux, ReadHeaderTimeout: 10 * time.Second}
	go func() {
		if err := srv.Serve(ln); err != nil && !errors.Is(err, http.ErrServerClosed) {
			log.Warn("metrics listener stopped", "err", err)
		}
	}()
	log.Info("metrics listener", "listen", ln.Addr().String(), "token", token)
	if tcp, ok := ln.Addr().(*net.TCPAddr); ok && !tcp.IP.IsLoopback() && !token {
		log.Warn("/metrics is reachable from the network without a token; set metrics_token", "listen", ln.Addr().String())
	}
	return func() { srv.Close() }, nil
}

// serveDebug serves net/http/pprof on addr until stop is called. It uses its own mux, not
// http.DefaultServeMux, so the profiles never leak onto the API listener.
func serveDebug(addr string, log *slog.Logger) (stop func(), err error) {
	ln, err := net.Listen("tcp", addr)
	if err != nil {
		return nil, fmt.Errorf("listen on %s: %w (set debug_listen or AENV_DEBUG_LISTEN)", addr, err)
	}
	// The mutex and block profiles are empty unless sampled: contention between the
	// API's handlers under a burst is what they are for. Sampled sparsely (1 in 100
	// contended unlocks, a sample per ms blocked), the cost is small.
	runtime.SetMutexProfileFraction(100)
	runtime.SetBlockProfileRate(int(time.Millisecond))
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
