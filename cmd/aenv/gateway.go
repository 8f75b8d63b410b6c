package main

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"os"
	"strings"
	"time"

	"github.com/spf13/cobra"

	"github.com/aenv-dev/aenv/internal/cluster/gateway"
	schedpkg "github.com/aenv-dev/aenv/internal/cluster/scheduler"
	pb "github.com/aenv-dev/aenv/internal/cluster/scheduler/gen/schedulerv1"
	"github.com/aenv-dev/aenv/internal/config"
)

func newGatewayCmd() *cobra.Command {
	var (
		listen, scheduler, logLevel, logFormat string
		domains                                []string
	)
	cmd := &cobra.Command{
		Use:   "gateway",
		Short: "Serve the cluster's E2B-compatible API, forwarding each call to the right node",
		Long: "gateway serves the API of every node of a cluster from one address and keeps no state:\n" +
			"creates are placed by the scheduler, sandbox calls and envd traffic go to the sandbox's node,\n" +
			"lists are merged across nodes. The cluster's API key comes from $AENV_API_KEY (every node\n" +
			"must be started with the same one). Point the E2B SDKs at it with\n" +
			"  E2B_API_URL=http://GATEWAY E2B_SANDBOX_URL=http://GATEWAY E2B_API_KEY=<key>",
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			log := newLogger(config.Config{LogLevel: logLevel, LogFormat: logFormat})
			key := os.Getenv("AENV_API_KEY")
			if key == "" {
				return errors.New("set AENV_API_KEY to the cluster's API key (the one every node is started with)")
			}
			conn, err := schedpkg.Dial(scheduler)
			if err != nil {
				return fmt.Errorf("--scheduler %s: %w", scheduler, err)
			}
			defer conn.Close()
			gw, err := gateway.New(gateway.Config{Scheduler: pb.NewSchedulerClient(conn), APIKeys: strings.Split(key, ","),
				Domains: domains, Logger: log})
			if err != nil {
				return err
			}
			ln, err := net.Listen("tcp", listen)
			if err != nil {
				return fmt.Errorf("listen on %s: %w (set --listen)", listen, err)
			}
			srv := &http.Server{Handler: gw, ReadHeaderTimeout: 10 * time.Second, IdleTimeout: 2 * time.Minute,
				ErrorLog: slog.NewLogLogger(log.Handler(), slog.LevelDebug)}
			errc := make(chan error, 1)
			go func() { errc <- srv.Serve(ln) }()
			log.Info("aenv gateway serving", "listen", ln.Addr().String(), "scheduler", scheduler)
			fmt.Fprintf(os.Stderr, "aenv: gateway on http://%s\n", ln.Addr())
			select {
			case err := <-errc:
				return fmt.Errorf("serve HTTP: %w", err)
			case <-cmd.Context().Done():
			}
			sctx, cancel := context.WithTimeout(context.WithoutCancel(cmd.Context()), 15*time.Second)
			defer cancel()
			if err := srv.Shutdown(sctx); err != nil {
				srv.Close()
			}
			return nil
		},
	}
	f := cmd.Flags()
	f.StringVar(&listen, "listen", "127.0.0.1:8080", "address of the cluster's API")
	f.StringVar(&scheduler, "scheduler", "127.0.0.1:9090", "the scheduler's gRPC address: one (a DNS name may resolve to every replica) or a comma-separated list of replicas")
	f.StringSliceVar(&domains, "proxy-domain", nil, "route Host {port}-{sandboxID}.{domain} to sandboxes (nodes need the same proxy.domains)")
	f.StringVar(&logLevel, "log-level", "info", "debug, info, warn or error")
	f.StringVar(&logFormat, "log-format", "text", "text or json")
	return cmd
}
