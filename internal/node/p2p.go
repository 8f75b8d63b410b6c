package node

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"os"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/aenv-dev/aenv/internal/cluster/p2p"
	"github.com/aenv-dev/aenv/internal/cluster/scheduler"
	pb "github.com/aenv-dev/aenv/internal/cluster/scheduler/gen/schedulerv1"
	"github.com/aenv-dev/aenv/internal/config"
)

// P2P is the node's part in peer-to-peer layer distribution (cluster.p2p): it serves
// the blobs the node holds whole on a listener of its own and reads lazily read layers
// from the peers the scheduler names.
type P2P struct {
	// Endpoint is the URL peers reach this node's blobs at (the heartbeat's p2p_endpoint).
	Endpoint string

	repo    *nodeRepository
	server  *p2p.Server
	fetcher *p2p.Fetcher
	http    *http.Server
	done    chan struct{}
	close   func() error // the scheduler connection
}

// startP2P starts the node's peer listener and sets the lazy layer resolver to read
// from peers first. Off (the default), it does nothing and returns nil.
func startP2P(cfg config.Config, repo *nodeRepository, reg prometheus.Registerer, log *slog.Logger) (*P2P, error) {
	pc := cfg.Cluster.P2P
	if !pc.Enabled {
		return nil, nil
	}
	log = log.With("component", "p2p")
	srv, err := p2p.NewServer(p2p.ServerOptions{Blobs: repo.cache, Token: pc.Token,
		UploadBytesPerSec: int64(pc.UploadMiBps) << 20, Logger: log})
	if err != nil {
		return nil, err
	}
	conn, err := scheduler.Dial(cfg.Cluster.Scheduler)
	if err != nil {
		return nil, fmt.Errorf("cluster.scheduler %s: %w", cfg.Cluster.Scheduler, err)
	}
	self := cfg.Cluster.NodeID
	if self == "" {
		self, _ = os.Hostname()
	}
	f, err := p2p.NewFetcher(p2p.FetcherOptions{Peers: p2p.SchedulerPeers{Client: pb.NewSchedulerClient(conn), Self: self},
		Token: pc.Token, Parallel: pc.Parallel, Timeout: pc.Timeout.Duration, Logger: log})
	if err != nil {
		conn.Close()
		return nil, err
	}
	ln, err := net.Listen("tcp", pc.Listen)
	if err != nil {
		conn.Close()
		return nil, fmt.Errorf("cluster.p2p.listen %s: %w", pc.Listen, err)
	}
	p := &P2P{Endpoint: pc.Advertise, repo: repo, server: srv, fetcher: f, done: make(chan struct{}), close: conn.Close,
		http: &http.Server{Handler: srv, ReadHeaderTimeout: 10 * time.Second, IdleTimeout: 2 * time.Minute,
			ErrorLog: slog.NewLogLogger(log.Handler(), slog.LevelDebug)}}
	if p.Endpoint == "" {
		p.Endpoint = "http://" + ln.Addr().String()
	}
	if err := p.register(reg); err != nil {
		ln.Close()
		conn.Close()
		return nil, err
	}
	go func() {
		defer close(p.done)
		if err := p.http.Serve(ln); !errors.Is(err, http.ErrServerClosed) {
			log.Error("p2p: the peer listener stopped", "err", err)
		}
	}()
	repo.layers.Peers = f
	log.Info("serving layers to peers", "listen", ln.Addr().String(), "endpoint", p.Endpoint,
		"upload_mib_per_s", pc.UploadMiBps)
	return p, nil
}

// Layers lists the blobs the node holds whole, which its heartbeats report so the
// scheduler can name it as a peer.
func (p *P2P) Layers() []string {
	ds := p.repo.cache.Local()
	out := make([]string, len(ds))
	for i, d := range ds {
		out[i] = string(d)
	}
	return out
}

// Close stops serving peers (requests in flight get a few seconds).
func (p *P2P) Close(ctx context.Context) {
	sctx, cancel := context.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	if err := p.http.Shutdown(sctx); err != nil {
		p.http.Close()
	}
	<-p.done
	p.close()
}

func (p *P2P) register(reg prometheus.Registerer) error {
	counter := func(name, help string, f func() int64) prometheus.Collector {
		return prometheus.NewCounterFunc(prometheus.CounterOpts{Name: name, Help: help}, func() float64 { return float64(f()) })
	}
	for _, c := range []prometheus.Collector{
		counter("aenv_p2p_fetched_bytes_total", "Bytes of lazily read layers read from peers (verified).",
			func() int64 { return p.fetcher.Stats().PeerBytes }),
		counter("aenv_p2p_fallback_bytes_total", "Bytes of lazily read layers read from the repository by the peer reader (no peer, a failed peer or a bad chunk).",
			func() int64 { return p.fetcher.Stats().RepositoryBytes }),
		counter("aenv_p2p_bad_chunks_total", "Chunks a peer served that did not match their published hash (read from the repository instead).",
			func() int64 { return p.fetcher.Stats().BadChunks }),
		counter("aenv_p2p_peer_errors_total", "Peer requests that failed (read from the repository instead).",
			func() int64 { return p.fetcher.Stats().PeerErrors }),
		counter("aenv_p2p_served_bytes_total", "Bytes this node uploaded to its peers.",
			func() int64 { return p.server.Stats().ServedBytes }),
		counter("aenv_p2p_refused_requests_total", "Peer requests refused for a missing or wrong cluster token.",
			func() int64 { return p.server.Stats().Refused }),
	} {
		if err := reg.Register(c); err != nil {
			return fmt.Errorf("register p2p metrics: %w", err)
		}
	}
	return nil
}
