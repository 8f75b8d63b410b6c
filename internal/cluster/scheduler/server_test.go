package scheduler

import (
	"context"
	"fmt"
	"net"
	"runtime"
	"slices"
	"sync"
	"syscall"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/health"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"
	"google.golang.org/grpc/status"

	pb "github.com/aenv-dev/aenv/internal/cluster/scheduler/gen/schedulerv1"
)

// startServer serves s on a loopback port and returns a client for it.
func startServer(tb testing.TB, s *State) pb.SchedulerClient {
	tb.Helper()
	return dialInsecure(tb, serveGRPC(tb, NewServer(s, nil)))
}

// serveGRPC serves srv with its production server options (and a health service,
// which replicas dial) on a loopback port until the test ends, and returns the address.
func serveGRPC(tb testing.TB, srv *Server) string {
	tb.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		tb.Fatal(err)
	}
	g := grpc.NewServer(srv.ServerOptions()...)
	srv.Register(g)
	healthpb.RegisterHealthServer(g, health.NewServer())
	go g.Serve(ln)
	tb.Cleanup(g.Stop)
	return ln.Addr().String()
}

func dialInsecure(tb testing.TB, addr string) pb.SchedulerClient {
	tb.Helper()
	conn, err := grpc.NewClient(addr, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		tb.Fatal(err)
	}
	tb.Cleanup(func() { conn.Close() })
	return pb.NewSchedulerClient(conn)
}

func TestServerRoundTrip(t *testing.T) {
	s, _ := newTestState(t)
	c := startServer(t, s)
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()

	watch, err := c.Watch(ctx, &pb.WatchRequest{})
	if err != nil {
		t.Fatal(err)
	}
	// The stream is set up once the server has sent headers; a heartbeat before that
	// could be published to no subscriber, so wait for them.
	if _, err := watch.Header(); err != nil {
		t.Fatal(err)
	}
	hbResp, err := c.Heartbeat(ctx, hb{id: "a", cpu: 4, mem: 4096}.req())
	if err != nil || hbResp.IntervalMs != 1000 {
		t.Fatalf("Heartbeat = %v, %v", hbResp, err)
	}
	p, err := c.Place(ctx, &pb.PlaceRequest{Resources: &pb.Resources{CpuCount: 1, MemoryMb: 512}})
	if err != nil || p.Node.Id != "a" || p.Node.Endpoint != "http://a:8000" {
		t.Fatalf("Place = %v, %v", p, err)
	}
	if _, err := c.Bind(ctx, &pb.BindRequest{SandboxId: "sb", NodeId: "a", ReservationId: p.ReservationId}); err != nil {
		t.Fatal(err)
	}
	l, err := c.Lookup(ctx, &pb.LookupRequest{SandboxId: "sb"})
	if err != nil || l.Node.Id != "a" || l.State != pb.NodeState_NODE_STATE_READY {
		t.Fatalf("Lookup = %v, %v", l, err)
	}
	nodes, err := c.ListNodes(ctx, &pb.ListNodesRequest{})
	if err != nil || len(nodes.Nodes) != 1 || nodes.Nodes[0].Reserved.CpuCount != 1 {
		t.Fatalf("ListNodes = %v, %v", nodes, err)
	}
	for _, want := range []pb.Event_Type{pb.Event_TYPE_NODE_UP, pb.Event_TYPE_SANDBOX_BOUND} {
		e, err := watch.Recv()
		if err != nil || e.Type != want {
			t.Fatalf("event = %v, %v; want %v", e, err, want)
		}
	}

	for _, tc := range []struct {
		call func() error
		code codes.Code
	}{
		{func() error { _, err := c.Lookup(ctx, &pb.LookupRequest{SandboxId: "nope"}); return err }, codes.NotFound},
		{func() error { _, err := c.Lookup(ctx, &pb.LookupRequest{}); return err }, codes.InvalidArgument},
		{func() error {
			_, err := c.Place(ctx, &pb.PlaceRequest{Resources: &pb.Resources{CpuCount: 99}})
			return err
		}, codes.ResourceExhausted},
		{func() error { _, err := c.Bind(ctx, &pb.BindRequest{SandboxId: "x", NodeId: "ghost"}); return err }, codes.FailedPrecondition},
		{func() error { _, err := c.Heartbeat(ctx, &pb.HeartbeatRequest{}); return err }, codes.InvalidArgument},
	} {
		if err := tc.call(); status.Code(err) != tc.code {
			t.Errorf("got %v, want code %v", err, tc.code)
		}
	}
}

// benchConfig keeps the benchmark's nodes fresh without heartbeats: a run under load
// outlasts the default staleness (10 s), after which nothing could be placed.
func benchConfig() Config { return Config{StaleAfter: time.Hour} }

// benchNodes registers n nodes with room for any number of placements.
func benchNodes(tb testing.TB, s *State, n int) {
	for i := range n {
		r := hb{id: fmt.Sprintf("node-%03d", i), cpu: 1 << 20, mem: 1 << 40,
			templates: []string{"base"}, layers: []string{"sha256:a", "sha256:b"}}.req()
		r.Node.Capacity.Sandboxes = 1 << 30
		if err := s.Heartbeat(r); err != nil {
			tb.Fatal(err)
		}
	}
}

// BenchmarkPlace is the placement decision itself (100 nodes), reservation included.
func BenchmarkPlace(b *testing.B) {
	s := New(benchConfig())
	benchNodes(b, s, 100)
	req := &pb.PlaceRequest{Resources: &pb.Resources{CpuCount: 1, MemoryMb: 512}, TemplateId: "base", Layers: []string{"sha256:a"}}
	b.ReportAllocs()
	b.ResetTimer()
	for b.Loop() {
		resp, err := s.Place(req)
		if err != nil {
			b.Fatal(err)
		}
		s.Release(resp.ReservationId)
	}
	b.ReportMetric(float64(b.N)/b.Elapsed().Seconds(), "placements/s")
}

// BenchmarkPlaceGRPC is what gateways see: Place over gRPC on loopback, 100 nodes,
// through the server options `aenv scheduler` uses (leader routing), from concurrent
// callers sharing one connection as a gateway's concurrent creates do. Each
// reservation is released in process (a gateway binds or releases it in a later call),
// so the state stays the size it has in a steady cluster. It reports placements/s and
// the p50 latency of one Place.
func BenchmarkPlaceGRPC(b *testing.B) {
	for _, callers := range []int{1, 8, 32} {
		b.Run(fmt.Sprintf("callers=%d", callers), func(b *testing.B) {
			s := New(benchConfig())
			benchNodes(b, s, 100)
			c := startServer(b, s)
			req := &pb.PlaceRequest{Resources: &pb.Resources{CpuCount: 1, MemoryMb: 512}, TemplateId: "base"}
			ctx := context.Background()
			var mu sync.Mutex
			var lat []time.Duration
			// RunParallel starts parallelism × GOMAXPROCS goroutines.
			b.SetParallelism(max(1, callers/runtime.GOMAXPROCS(0)))
			b.ResetTimer()
			start, cpu0 := time.Now(), cpuTime(b)
			b.RunParallel(func(p *testing.PB) {
				var mine []time.Duration
				for p.Next() {
					t0 := time.Now()
					resp, err := c.Place(ctx, req)
					mine = append(mine, time.Since(t0))
					if err != nil {
						b.Error(err)
						return
					}
					s.Release(resp.ReservationId)
				}
				mu.Lock()
				lat = append(lat, mine...)
				mu.Unlock()
			})
			b.ReportMetric(float64(b.N)/time.Since(start).Seconds(), "placements/s")
			// CPU time (client and server, both in this process) per placement: what the
			// figure would be on dedicated CPUs, where a shared machine's wall clock is not.
			b.ReportMetric(float64((cpuTime(b)-cpu0).Microseconds())/float64(b.N), "cpu-µs/op")
			if len(lat) > 0 {
				slices.Sort(lat)
				b.ReportMetric(float64(lat[len(lat)/2].Microseconds()), "p50-µs")
			}
		})
	}
}

// cpuTime is the CPU time this process has used (user + system).
func cpuTime(tb testing.TB) time.Duration {
	var ru syscall.Rusage
	if err := syscall.Getrusage(syscall.RUSAGE_SELF, &ru); err != nil {
		tb.Fatal(err)
	}
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
}
