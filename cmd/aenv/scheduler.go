package main

import (
	"errors"
	"fmt"
	"net"
	"os"
	"time"

	"github.com/spf13/cobra"
	"google.golang.org/grpc"

	"github.com/aenv-dev/aenv/internal/cluster/scheduler"
	"github.com/aenv-dev/aenv/internal/config"
)

func newSchedulerCmd() *cobra.Command {
	var (
		listen    string
		cfg       scheduler.Config
		logLevel  string
		logFormat string
	)
	cmd := &cobra.Command{
		Use:   "scheduler",
		Short: "Run the cluster scheduler: node heartbeats, placement and sandbox lookup (gRPC)",
		Long: "scheduler keeps the cluster's view of its nodes (capacity, allocations, sandboxes, layers),\n" +
			"reported by `aenv serve --scheduler ADDR` heartbeats, and answers gateways' placement and\n" +
			"lookup calls. Its state is memory only and rebuilt from heartbeats after a restart.",
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			log := newLogger(config.Config{LogLevel: logLevel, LogFormat: logFormat})
			ln, err := net.Listen("tcp", listen)
			if err != nil {
				return fmt.Errorf("listen on %s: %w (set --listen)", listen, err)
			}
			state := scheduler.New(cfg)
			g := grpc.NewServer()
			scheduler.NewServer(state, log).Register(g)
			go state.Run(cmd.Context())
			errc := make(chan error, 1)
			go func() { errc <- g.Serve(ln) }()
			log.Info("aenv scheduler serving", "listen", ln.Addr().String())
			fmt.Fprintf(os.Stderr, "aenv: scheduler on %s\n", ln.Addr())
			select {
			case err := <-errc:
				if !errors.Is(err, grpc.ErrServerStopped) {
					return fmt.Errorf("serve gRPC: %w", err)
				}
			case <-cmd.Context().Done():
			}
			stopGracefully(g, 5*time.Second)
			return nil
		},
	}
	f := cmd.Flags()
	f.StringVar(&listen, "listen", "127.0.0.1:9090", "gRPC listen address")
	f.DurationVar(&cfg.HeartbeatInterval, "heartbeat-interval", 2*time.Second, "heartbeat interval nodes are asked to keep")
	f.DurationVar(&cfg.StaleAfter, "stale-after", 0, "heartbeat age after which a node gets no placements (default 5 intervals)")
	f.DurationVar(&cfg.ForgetAfter, "forget-after", 10*time.Minute, "heartbeat age after which a node and its sandboxes are forgotten")
	f.IntVar(&cfg.Choices, "choices", 2, "placement draws this many fitting nodes and takes the least loaded")
	f.StringVar(&logLevel, "log-level", "info", "debug, info, warn or error")
	f.StringVar(&logFormat, "log-format", "text", "text or json")
	return cmd
}

// stopGracefully lets in-flight RPCs finish, then cuts streams (watchers) at the deadline.
func stopGracefully(g *grpc.Server, d time.Duration) {
	done := make(chan struct{})
	go func() { g.GracefulStop(); close(done) }()
	select {
	case <-done:
	case <-time.After(d):
		g.Stop()
	}
}
