package scheduler

import (
	"context"
	"errors"
	"log/slog"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/reflect/protoreflect"

	pb "github.com/aenv-dev/aenv/internal/cluster/scheduler/gen/schedulerv1"
)

// Server serves State over gRPC.
type Server struct {
	pb.UnimplementedSchedulerServer
	state *State
	log   *slog.Logger
	rep   replica
	types map[string][2]protoreflect.MessageType
	// metrics is nil until EnableMetrics.
	metrics *metrics
}

// NewServer wraps s for gRPC; register it with pb.RegisterSchedulerServer.
func NewServer(s *State, log *slog.Logger) *Server {
	if log == nil {
		log = slog.Default()
	}
	return &Server{state: s, log: log, rep: replica{leading: true, term: make(chan struct{})}, types: methodTypes()}
}

// ServerOptions are the options a gRPC server needs for this Server to forward calls to
// the leader while it follows (see Lead and Follow).
func (srv *Server) ServerOptions() []grpc.ServerOption {
	return []grpc.ServerOption{grpc.ChainUnaryInterceptor(srv.UnaryInterceptor()),
		grpc.ChainStreamInterceptor(srv.StreamInterceptor())}
}

// Register adds the scheduler service to g.
func (srv *Server) Register(g *grpc.Server) { pb.RegisterSchedulerServer(g, srv) }

// Run sweeps expired reservations and stale nodes until ctx ends.
func (s *State) Run(ctx context.Context) {
	t := time.NewTicker(max(s.cfg.HeartbeatInterval/2, 100*time.Millisecond))
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
			s.Sweep()
		}
	}
}

// grpcError maps State errors to status codes the gateway turns into HTTP statuses.
func grpcError(err error) error {
	switch {
	case err == nil:
		return nil
	case errors.Is(err, ErrInvalid):
		return status.Error(codes.InvalidArgument, err.Error())
	case errors.Is(err, ErrNotFound):
		return status.Error(codes.NotFound, err.Error())
	case errors.Is(err, ErrUnknownNode):
		return status.Error(codes.FailedPrecondition, err.Error())
	case errors.Is(err, ErrWarmingUp):
		return status.Error(codes.Unavailable, err.Error())
	case errors.Is(err, ErrNoCapacity):
		return status.Error(codes.ResourceExhausted, err.Error())
	}
	return status.Error(codes.Internal, err.Error())
}

func (srv *Server) Heartbeat(_ context.Context, req *pb.HeartbeatRequest) (*pb.HeartbeatResponse, error) {
	err := srv.state.Heartbeat(req)
	srv.metrics.heartbeat(err)
	if err != nil {
		return nil, grpcError(err)
	}
	return &pb.HeartbeatResponse{IntervalMs: srv.state.Interval().Milliseconds()}, nil
}

func (srv *Server) Unregister(_ context.Context, req *pb.UnregisterRequest) (*pb.UnregisterResponse, error) {
	return &pb.UnregisterResponse{}, grpcError(srv.state.Unregister(req.NodeId, req.InstanceId))
}

func (srv *Server) Place(_ context.Context, req *pb.PlaceRequest) (*pb.PlaceResponse, error) {
	start := time.Now()
	resp, err := srv.state.Place(req)
	srv.metrics.placed(time.Since(start), err)
	return resp, grpcError(err)
}

func (srv *Server) Bind(_ context.Context, req *pb.BindRequest) (*pb.BindResponse, error) {
	return &pb.BindResponse{}, grpcError(srv.state.Bind(req.SandboxId, req.NodeId, req.ReservationId))
}

func (srv *Server) Release(_ context.Context, req *pb.ReleaseRequest) (*pb.ReleaseResponse, error) {
	srv.state.Release(req.ReservationId)
	return &pb.ReleaseResponse{}, nil
}

func (srv *Server) Lookup(_ context.Context, req *pb.LookupRequest) (*pb.LookupResponse, error) {
	resp, err := srv.state.Lookup(req.SandboxId)
	return resp, grpcError(err)
}

func (srv *Server) ListNodes(context.Context, *pb.ListNodesRequest) (*pb.ListNodesResponse, error) {
	return &pb.ListNodesResponse{Nodes: srv.state.Nodes()}, nil
}

func (srv *Server) ListPeers(_ context.Context, req *pb.ListPeersRequest) (*pb.ListPeersResponse, error) {
	peers, err := srv.state.Peers(req.Layer, req.ExcludeNodeId)
	return &pb.ListPeersResponse{Peers: peers}, grpcError(err)
}

func (srv *Server) Watch(_ *pb.WatchRequest, stream grpc.ServerStreamingServer[pb.Event]) error {
	sub := srv.state.events.subscribe()
	defer srv.state.events.unsubscribe(sub)
	// Headers tell the client it is subscribed: events from here on reach it.
	if err := stream.SendHeader(nil); err != nil {
		return err
	}
	for {
		select {
		case <-stream.Context().Done():
			return nil
		case <-sub.lagged:
			return status.Error(codes.ResourceExhausted, "watcher fell behind the event stream; list nodes and watch again")
		case e := <-sub.C:
			if err := stream.Send(e); err != nil {
				return err
			}
		}
	}
}
