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

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"
	"github.com/prometheus/client_golang/prometheus/promhttp"
	"github.com/spf13/cobra"
	"google.golang.org/grpc"
	"google.golang.org/grpc/health"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"

	"github.com/aenv-dev/aenv/internal/cluster/kube"
	"github.com/aenv-dev/aenv/internal/cluster/scheduler"
	"github.com/aenv-dev/aenv/internal/config"
)

// schedulerKube is how the scheduler uses Kubernetes (all optional).
type schedulerKube struct {
	kubeconfig, namespace, lease, advertise, nodesService string
	leaseDuration, renewDeadline, retryPeriod             time.Duration
}

func newSchedulerCmd() *cobra.Command {
	var (
		listen    string
		metrics   string
		cfg       scheduler.Config
		logLevel  string
		logFormat string
		nodes     []string
		k         schedulerKube
	)
	cmd := &cobra.Command{
		Use:   "scheduler",
		Short: "Run the cluster scheduler: node heartbeats, placement and sandbox lookup (gRPC)",
		Long: "scheduler keeps the cluster's view of its nodes (capacity, allocations, sandboxes, layers),\n" +
			"reported by `aenv serve --scheduler ADDR` heartbeats, and answers gateways' placement and\n" +
			"lookup calls. Its state is memory only and rebuilt from heartbeats after a restart.\n\n" +
			"With --lease, several replicas elect a leader through a Kubernetes Lease; the others forward\n" +
			"every call to it. --nodes or --nodes-service restrict the cluster to discovered nodes.",
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			log := newLogger(config.Config{LogLevel: logLevel, LogFormat: logFormat})
			if len(nodes) > 0 && k.nodesService != "" {
				return errors.New("--nodes and --nodes-service are two ways to discover nodes: use one")
			}
			ln, err := net.Listen("tcp", listen)
			if err != nil {
				return fmt.Errorf("listen on %s: %w (set --listen)", listen, err)
			}
			defer ln.Close()
			state := scheduler.New(cfg)
			srv := scheduler.NewServer(state, log)
			defer srv.Close()
			if len(nodes) > 0 {
				state.SetMembers(staticMembers(nodes))
			}
			ctx, cancel := context.WithCancel(cmd.Context())
			defer cancel()
			if metrics != "" {
				stopMetrics, err := serveSchedulerMetrics(metrics, srv, log)
				if err != nil {
					return err
				}
				defer stopMetrics()
			}
			elected, err := startSchedulerKube(ctx, k, ln.Addr(), state, srv, log)
			if err != nil {
				return err
			}
			g := grpc.NewServer(srv.ServerOptions()...)
			srv.Register(g)
			hs := health.NewServer()
			healthpb.RegisterHealthServer(g, hs)
			go state.Run(ctx)
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
			hs.Shutdown()
			// Give up the Lease first, so the other replica leads while this one drains.
			cancel()
			<-elected
			stopGracefully(g, 5*time.Second)
			return nil
		},
	}
	f := cmd.Flags()
	f.StringVar(&listen, "listen", "127.0.0.1:9090", "gRPC listen address")
	f.StringVar(&metrics, "metrics-listen", "", "serve Prometheus metrics on GET /metrics at this address (e.g. 0.0.0.0:9101; default off)")
	f.DurationVar(&cfg.HeartbeatInterval, "heartbeat-interval", 2*time.Second, "heartbeat interval nodes are asked to keep")
	f.DurationVar(&cfg.StaleAfter, "stale-after", 0, "heartbeat age after which a node gets no placements (default 5 intervals)")
	f.DurationVar(&cfg.ForgetAfter, "forget-after", 10*time.Minute, "heartbeat age after which a node and its sandboxes are forgotten")
	f.IntVar(&cfg.Choices, "choices", 2, "placement draws this many fitting nodes and takes the least loaded")
	f.StringVar(&logLevel, "log-level", "info", "debug, info, warn or error")
	f.StringVar(&logFormat, "log-format", "text", "text or json")
	f.StringSliceVar(&nodes, "nodes", nil, "static discovery: the node ids allowed to join (default: any node that heartbeats)")
	f.StringVar(&k.nodesService, "nodes-service", "", "Kubernetes discovery: nodes are the endpoints of this Service's EndpointSlices")
	f.StringVar(&k.lease, "lease", "", "elect a leader among scheduler replicas through this coordination.k8s.io Lease")
	f.StringVar(&k.advertise, "advertise", "", "with --lease: this replica's gRPC address for the others (default: the listen address; in a pod $POD_IP and the listen port)")
	f.StringVar(&k.namespace, "namespace", "", "namespace of the Lease and the nodes' Service (default: $POD_NAMESPACE or the pod's own)")
	f.StringVar(&k.kubeconfig, "kubeconfig", "", "kubeconfig file (default: the pod's service account)")
	f.DurationVar(&k.leaseDuration, "lease-duration", 15*time.Second, "a leader that stops renewing the Lease is replaced after this long")
	f.DurationVar(&k.renewDeadline, "renew-deadline", 10*time.Second, "a leader that cannot renew the Lease within this steps down")
	f.DurationVar(&k.retryPeriod, "retry-period", 2*time.Second, "how often replicas try to take or renew the Lease")
	return cmd
}

func staticMembers(ids []string) []scheduler.Member {
	m := make([]scheduler.Member, 0, len(ids))
	for _, id := range ids {
		if id = strings.TrimSpace(id); id != "" {
			m = append(m, scheduler.Member{ID: id, Serving: true})
		}
	}
	return m
}

// startSchedulerKube starts EndpointSlice discovery and leader election where asked;
// the returned channel closes once the election has ended (its Lease released).
func startSchedulerKube(ctx context.Context, k schedulerKube, addr net.Addr, state *scheduler.State,
	srv *scheduler.Server, log *slog.Logger) (<-chan struct{}, error) {
	done := make(chan struct{})
	if k.lease == "" && k.nodesService == "" {
		close(done)
		return done, nil
	}
	cs, err := kube.Client(k.kubeconfig)
	if err != nil {
		return nil, err
	}
	ns := k.namespace
	if ns == "" {
		ns = kube.Namespace()
	}
	if k.nodesService != "" {
		if err := kube.WatchNodes(ctx, cs, ns, k.nodesService, state, 30*time.Second, log); err != nil {
			return nil, err
		}
	}
	if k.lease == "" {
		close(done)
		return done, nil
	}
	adv, err := advertiseAddr(k.advertise, addr)
	if err != nil {
		return nil, err
	}
	// Follow until the election says otherwise: serving calls before then would answer
	// from an empty state as if it led.
	srv.Follow("")
	go func() {
		defer close(done)
		err := kube.RunElection(ctx, cs, kube.Election{Namespace: ns, Lease: k.lease, Address: adv,
			LeaseDuration: k.leaseDuration, RenewDeadline: k.renewDeadline, RetryPeriod: k.retryPeriod, Log: log}, srv)
		if err != nil {
			log.Error("scheduler leader election stopped", "err", err)
		}
	}()
	return done, nil
}

// advertiseAddr is the address other replicas dial this one at.
func advertiseAddr(flag string, addr net.Addr) (string, error) {
	if flag != "" {
		return flag, nil
	}
	tcp, ok := addr.(*net.TCPAddr)
	if !ok {
		return "", fmt.Errorf("cannot advertise %s: set --advertise", addr)
	}
	if !tcp.IP.IsUnspecified() {
		return tcp.String(), nil
	}
	if ip := os.Getenv("POD_IP"); ip != "" {
		return net.JoinHostPort(ip, fmt.Sprint(tcp.Port)), nil
	}
	return "", fmt.Errorf("the scheduler listens on %s, which other replicas cannot dial: set --advertise (or $POD_IP)", addr)
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

// serveSchedulerMetrics serves the scheduler's metrics, with the Go runtime's and the
// process's, on GET /metrics at addr until the returned stop is called.
func serveSchedulerMetrics(addr string, srv *scheduler.Server, log *slog.Logger) (stop func(), err error) {
	reg := prometheus.NewRegistry()
	reg.MustRegister(collectors.NewGoCollector(), collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}))
	if err := srv.EnableMetrics(reg); err != nil {
		return nil, err
	}
	ln, err := net.Listen("tcp", addr)
	if err != nil {
		return nil, fmt.Errorf("listen for metrics on %s: %w (set --metrics-listen)", addr, err)
	}
	mux := http.NewServeMux()
	mux.Handle("GET /metrics", promhttp.HandlerFor(reg, promhttp.HandlerOpts{}))
	hs := &http.Server{Handler: mux, ReadHeaderTimeout: 10 * time.Second}
	go func() {
		if err := hs.Serve(ln); err != nil && !errors.Is(err, http.ErrServerClosed) {
			log.Error("metrics listener stopped", "err", err)
		}
	}()
	log.Info("scheduler metrics", "listen", ln.Addr().String())
	fmt.Fprintf(os.Stderr, "aenv: scheduler metrics on http://%s/metrics\n", ln.Addr())
	return func() { hs.Close() }, nil
}
