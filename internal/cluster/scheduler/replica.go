package scheduler

import (
	"context"
	"fmt"
	"io"
	"sync"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/reflect/protoreflect"
	"google.golang.org/protobuf/reflect/protoregistry"

	pb "github.com/aenv-dev/aenv/internal/cluster/scheduler/gen/schedulerv1"
)

// Replication: several scheduler replicas run, one of them (elected through a
// Kubernetes Lease by the kube package) leads. Only the leader keeps state; a follower
// forwards every call to the leader, so nodes and gateways may talk to any replica. A
// replica that starts leading begins with an empty state and a fresh warm-up, and
// learns the cluster from the heartbeats that reach it (nodes are the source of truth).
// A replica that never hears of an election (a lone scheduler) is the leader.

// forwardedHeader marks a forwarded call: a replica that receives one while it does not
// lead answers UNAVAILABLE instead of forwarding again (two replicas that each believe
// the other leads must not bounce a call between them).
const forwardedHeader = "x-aenv-scheduler-forwarded"

// replica is a Server's leadership state.
type replica struct {
	mu       sync.Mutex
	leading  bool
	leader   string        // the leader's gRPC address, when following and known
	term     chan struct{} // closed when this replica stops leading: ends its Watch streams
	conn     *grpc.ClientConn
	connAddr string
}

// Lead makes this replica the leader: it starts from an empty state that warms up from
// the next heartbeats. Called when the replica acquires the Lease.
func (srv *Server) Lead() {
	srv.rep.mu.Lock()
	defer srv.rep.mu.Unlock()
	if srv.rep.leading {
		return
	}
	srv.state.Reset()
	srv.rep.leading = true
	srv.rep.leader = ""
	srv.rep.term = make(chan struct{})
	srv.log.Info("leading the scheduler replicas: learning the cluster from heartbeats")
}

// Follow makes this replica forward calls to the leader at addr ("" while no leader is
// known: calls then answer UNAVAILABLE). A leader that steps down drops its state.
func (srv *Server) Follow(addr string) {
	srv.rep.mu.Lock()
	defer srv.rep.mu.Unlock()
	if srv.rep.leading {
		close(srv.rep.term)
		srv.state.Reset()
		srv.rep.leading = false
		srv.log.Warn("stopped leading the scheduler replicas")
	}
	if srv.rep.leader != addr {
		srv.log.Info("following the scheduler leader", "leader", addr)
	}
	srv.rep.leader = addr
}

// Leading reports whether this replica serves calls itself.
func (srv *Server) Leading() bool {
	srv.rep.mu.Lock()
	defer srv.rep.mu.Unlock()
	return srv.rep.leading
}

// Close releases the connection to the leader.
func (srv *Server) Close() {
	srv.rep.mu.Lock()
	defer srv.rep.mu.Unlock()
	if srv.rep.conn != nil {
		srv.rep.conn.Close()
		srv.rep.conn = nil
	}
}

// route returns nil when this replica serves the call, or the connection to forward it
// on; term is closed when this replica stops leading.
func (srv *Server) route(ctx context.Context) (conn *grpc.ClientConn, term <-chan struct{}, err error) {
	srv.rep.mu.Lock()
	defer srv.rep.mu.Unlock()
	if srv.rep.leading {
		return nil, srv.rep.term, nil
	}
	if md, _ := metadata.FromIncomingContext(ctx); len(md.Get(forwardedHeader)) > 0 {
		return nil, nil, status.Error(codes.Unavailable, "this scheduler replica does not lead (leadership is changing); try again")
	}
	if srv.rep.leader == "" {
		return nil, nil, status.Error(codes.Unavailable, "no scheduler replica leads yet (the Lease is being taken over); try again")
	}
	if srv.rep.conn == nil || srv.rep.connAddr != srv.rep.leader {
		if srv.rep.conn != nil {
			srv.rep.conn.Close()
		}
		c, err := grpc.NewClient(srv.rep.leader, grpc.WithTransportCredentials(insecure.NewCredentials()))
		if err != nil {
			return nil, nil, status.Errorf(codes.Unavailable, "dial the scheduler leader %s: %v", srv.rep.leader, err)
		}
		srv.rep.conn, srv.rep.connAddr = c, srv.rep.leader
	}
	return srv.rep.conn, nil, nil
}

// methodTypes maps each Scheduler method's full name to its request and response types,
// so forwarding needs no per-method code.
func methodTypes() map[string][2]protoreflect.MessageType {
	out := map[string][2]protoreflect.MessageType{}
	svc := pb.File_scheduler_v1_scheduler_proto.Services().ByName("Scheduler")
	for i := 0; i < svc.Methods().Len(); i++ {
		m := svc.Methods().Get(i)
		in, err1 := protoregistry.GlobalTypes.FindMessageByName(m.Input().FullName())
		out1, err2 := protoregistry.GlobalTypes.FindMessageByName(m.Output().FullName())
		if err1 != nil || err2 != nil {
			panic(fmt.Sprintf("scheduler proto types of %s are not registered", m.FullName()))
		}
		out[fmt.Sprintf("/%s/%s", svc.FullName(), m.Name())] = [2]protoreflect.MessageType{in, out1}
	}
	return out
}

func forwardContext(ctx context.Context) context.Context {
	md, _ := metadata.FromIncomingContext(ctx)
	md = md.Copy()
	md.Set(forwardedHeader, "1")
	return metadata.NewOutgoingContext(ctx, md)
}

// UnaryInterceptor forwards unary calls to the leader when this replica follows.
func (srv *Server) UnaryInterceptor() grpc.UnaryServerInterceptor {
	return func(ctx context.Context, req any, info *grpc.UnaryServerInfo, handler grpc.UnaryHandler) (any, error) {
		types, ok := srv.types[info.FullMethod]
		if !ok {
			return handler(ctx, req) // another service (health): every replica answers itself
		}
		conn, _, err := srv.route(ctx)
		if err != nil {
			return nil, err
		}
		if conn == nil {
			return handler(ctx, req)
		}
		reply := types[1].New().Interface()
		if err := conn.Invoke(forwardContext(ctx), info.FullMethod, req, reply); err != nil {
			return nil, err
		}
		return reply, nil
	}
}

// StreamInterceptor relays server streams (Watch) from the leader when this replica
// follows, and ends a leader's streams when it stops leading.
func (srv *Server) StreamInterceptor() grpc.StreamServerInterceptor {
	return func(s any, ss grpc.ServerStream, info *grpc.StreamServerInfo, handler grpc.StreamHandler) error {
		types, ok := srv.types[info.FullMethod]
		if !ok {
			return handler(s, ss)
		}
		conn, term, err := srv.route(ss.Context())
		if err != nil {
			return err
		}
		if conn == nil {
			return srv.serveTerm(s, ss, term, handler)
		}
		return relay(ss, conn, info.FullMethod, types)
	}
}

// serveTerm runs a leader's stream until it ends or the replica stops leading.
func (srv *Server) serveTerm(s any, ss grpc.ServerStream, term <-chan struct{}, handler grpc.StreamHandler) error {
	ctx, cancel := context.WithCancel(ss.Context())
	defer cancel()
	stopped := make(chan struct{})
	go func() {
		select {
		case <-term:
			cancel()
			close(stopped)
		case <-ctx.Done():
		}
	}()
	err := handler(s, &ctxStream{ServerStream: ss, ctx: ctx})
	select {
	case <-stopped:
		return status.Error(codes.Unavailable, "this scheduler replica stopped leading; watch again")
	default:
		return err
	}
}

type ctxStream struct {
	grpc.ServerStream
	ctx context.Context
}

func (c *ctxStream) Context() context.Context { return c.ctx }

func relay(ss grpc.ServerStream, conn *grpc.ClientConn, method string, types [2]protoreflect.MessageType) error {
	in := types[0].New().Interface()
	if err := ss.RecvMsg(in); err != nil {
		return err
	}
	cs, err := conn.NewStream(forwardContext(ss.Context()), &grpc.StreamDesc{ServerStreams: true}, method)
	if err != nil {
		return err
	}
	if err := cs.SendMsg(in); err != nil {
		return err
	}
	if err := cs.CloseSend(); err != nil {
		return err
	}
	md, err := cs.Header()
	if err != nil {
		return err
	}
	if err := ss.SendHeader(md); err != nil {
		return err
	}
	for {
		out := types[1].New().Interface()
		if err := cs.RecvMsg(out); err != nil {
			if err == io.EOF {
				return nil
			}
			return err
		}
		if err := ss.SendMsg(out); err != nil {
			return err
		}
	}
}
