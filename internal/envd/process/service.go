// Package process implements E2B's process.Process Connect service: start commands (pipes or a
// PTY) as the requesting user, stream their output, re-attach, send input and signals.
package process

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net/http"
	"os"
	"strconv"
	"sync"
	"syscall"
	"time"

	"connectrpc.com/connect"

	pb "github.com/aenv-dev/aenv/internal/envd/gen/process"
	"github.com/aenv-dev/aenv/internal/envd/gen/process/processconnect"
	"github.com/aenv-dev/aenv/internal/envd/identity"
	"github.com/aenv-dev/aenv/internal/envd/reaper"
	"github.com/aenv-dev/aenv/internal/envd/state"
)

const (
	// DefaultKeepalive applies when the client sends no valid Keepalive-Ping-Interval header.
	DefaultKeepalive = 90 * time.Second
	// finished processes stay addressable by Connect (which replays start + end) for a while.
	retainFinished    = 60 * time.Second
	maxRetainFinished = 256
)

// Options configure a Service.
type Options struct {
	Defaults *state.Defaults
	Users    identity.DB
	Waiter   reaper.Waiter // nil: reaper.Direct{}
	Logger   *slog.Logger  // nil: slog.Default()
}

// Service implements processconnect.ProcessHandler.
type Service struct {
	defaults *state.Defaults
	users    identity.DB
	waiter   reaper.Waiter
	log      *slog.Logger

	mu       sync.Mutex
	running  map[uint32]*proc
	finished []*proc // oldest first
}

var _ processconnect.ProcessHandler = (*Service)(nil)

// New returns a Service.
func New(o Options) *Service {
	if o.Waiter == nil {
		o.Waiter = reaper.Direct{}
	}
	if o.Logger == nil {
		o.Logger = slog.Default()
	}
	if o.Defaults == nil {
		o.Defaults = state.New("root")
	}
	return &Service{defaults: o.Defaults, users: o.Users, waiter: o.Waiter, log: o.Logger, running: map[uint32]*proc{}}
}

func (s *Service) register(p *proc) {
	s.mu.Lock()
	s.running[p.pid] = p
	s.mu.Unlock()
}

// retire moves a finished process from the running table to the bounded finished list.
func (s *Service) retire(p *proc) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.running[p.pid] == p {
		delete(s.running, p.pid)
	}
	s.finished = append(s.finished, p)
	s.pruneLocked(time.Now())
}

func (s *Service) pruneLocked(now time.Time) {
	i := 0
	for i < len(s.finished) && (len(s.finished)-i > maxRetainFinished || now.Sub(s.finished[i].endedAt) > retainFinished) {
		s.finished[i] = nil
		i++
	}
	if i > 0 {
		s.finished = append(s.finished[:0], s.finished[i:]...)
	}
}

// lookup finds a process by selector: running ones first, then recently finished ones.
func (s *Service) lookup(sel *pb.ProcessSelector) (*proc, error) {
	if sel == nil || sel.GetSelector() == nil {
		return nil, connect.NewError(connect.CodeInvalidArgument, errors.New("process selector (pid or tag) is required"))
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	s.pruneLocked(time.Now())
	switch v := sel.GetSelector().(type) {
	case *pb.ProcessSelector_Pid:
		if p := s.running[v.Pid]; p != nil {
			return p, nil
		}
		for i := len(s.finished) - 1; i >= 0; i-- {
			if s.finished[i].pid == v.Pid {
				return s.finished[i], nil
			}
		}
		return nil, connect.NewError(connect.CodeNotFound, fmt.Errorf("process with pid %d not found", v.Pid))
	case *pb.ProcessSelector_Tag:
		var best *proc
		for _, p := range s.running {
			if p.tag != nil && *p.tag == v.Tag && (best == nil || p.pid > best.pid) {
				best = p
			}
		}
		if best != nil {
			return best, nil
		}
		for i := len(s.finished) - 1; i >= 0; i-- {
			if p := s.finished[i]; p.tag != nil && *p.tag == v.Tag {
				return p, nil
			}
		}
		return nil, connect.NewError(connect.CodeNotFound, fmt.Errorf("process with tag '%s' not found", v.Tag))
	}
	return nil, connect.NewError(connect.CodeInvalidArgument, errors.New("unknown process selector"))
}

// lookupRunning is lookup for operations that need a live process.
func (s *Service) lookupRunning(sel *pb.ProcessSelector) (*proc, error) {
	p, err := s.lookup(sel)
	if err != nil {
		return nil, err
	}
	select {
	case <-p.done:
		return nil, connect.NewError(connect.CodeNotFound, fmt.Errorf("process with pid %d not found", p.pid))
	default:
		return p, nil
	}
}

// user resolves the acting user: HTTP Basic auth, else the sandbox default.
func (s *Service) user(h http.Header) (*identity.User, state.Snapshot, error) {
	snap := s.defaults.Snapshot()
	name, ok := identity.BasicUser(h.Get("Authorization"))
	if !ok {
		name = snap.User
	}
	u, err := s.users.Lookup(name)
	if err != nil {
		return nil, snap, connect.NewError(connect.CodeUnauthenticated, fmt.Errorf("invalid username: '%s'", name))
	}
	return u, snap, nil
}

// keepaliveInterval reads Keepalive-Ping-Interval (seconds).
func keepaliveInterval(h http.Header) time.Duration {
	if v := h.Get("Keepalive-Ping-Interval"); v != "" {
		if n, err := strconv.Atoi(v); err == nil && n > 0 {
			return time.Duration(n) * time.Second
		}
	}
	return DefaultKeepalive
}

// Start implements the Start RPC.
func (s *Service) Start(ctx context.Context, req *connect.Request[pb.StartRequest], stream *connect.ServerStream[pb.StartResponse]) error {
	u, snap, err := s.user(req.Header())
	if err != nil {
		return err
	}
	sp, err := s.prepare(u, req.Msg, snap)
	if err != nil {
		return err
	}
	// connect-timeout-ms (already a context deadline) kills the process when it runs out, even if
	// the client went away; no deadline means no limit.
	if dl, ok := ctx.Deadline(); ok {
		sp.timeout = max(time.Until(dl), time.Millisecond)
	}
	p, sub, err := s.start(sp, true)
	if err != nil {
		return err
	}
	send := func(ev *pb.ProcessEvent) error { return stream.Send(&pb.StartResponse{Event: ev}) }
	return s.pump(ctx, p, sub, send, keepaliveInterval(req.Header()))
}

// Connect implements the Connect RPC: re-attach to a running (or just finished) process.
func (s *Service) Connect(ctx context.Context, req *connect.Request[pb.ConnectRequest], stream *connect.ServerStream[pb.ConnectResponse]) error {
	if _, _, err := s.user(req.Header()); err != nil {
		return err
	}
	p, err := s.lookup(req.Msg.GetProcess())
	if err != nil {
		return err
	}
	send := func(ev *pb.ProcessEvent) error { return stream.Send(&pb.ConnectResponse{Event: ev}) }
	sub, end := p.hub.subscribe()
	if end != nil {
		if err := send(startEvent(p.pid)); err != nil {
			return err
		}
		return send(end)
	}
	return s.pump(ctx, p, sub, send, keepaliveInterval(req.Header()))
}

func startEvent(pid uint32) *pb.ProcessEvent {
	return &pb.ProcessEvent{Event: &pb.ProcessEvent_Start{Start: &pb.ProcessEvent_StartEvent{Pid: pid}}}
}

var keepaliveEvent = &pb.ProcessEvent{Event: &pb.ProcessEvent_Keepalive{Keepalive: &pb.ProcessEvent_KeepAlive{}}}

// pump sends start, then every event of sub until the end event, with keepalives in quiet periods.
// A client that goes away detaches; the process keeps running.
func (s *Service) pump(ctx context.Context, p *proc, sub *subscriber, send func(*pb.ProcessEvent) error, every time.Duration) error {
	defer p.hub.unsubscribe(sub)
	if err := send(startEvent(p.pid)); err != nil {
		return err
	}
	ka := time.NewTimer(every)
	defer ka.Stop()
	for {
		select {
		case ev := <-sub.ch:
			if err := send(ev); err != nil {
				return err
			}
			if ev.GetEnd() != nil {
				return nil
			}
			ka.Reset(every)
		case <-ka.C:
			if err := send(keepaliveEvent); err != nil {
				return err
			}
			ka.Reset(every)
		case <-ctx.Done():
			if errors.Is(ctx.Err(), context.DeadlineExceeded) {
				return connect.NewError(connect.CodeDeadlineExceeded, ctx.Err())
			}
			return connect.NewError(connect.CodeCanceled, ctx.Err())
		}
	}
}

// List implements the List RPC: running processes.
func (s *Service) List(ctx context.Context, req *connect.Request[pb.ListRequest]) (*connect.Response[pb.ListResponse], error) {
	if _, _, err := s.user(req.Header()); err != nil {
		return nil, err
	}
	s.mu.Lock()
	out := make([]*pb.ProcessInfo, 0, len(s.running))
	for _, p := range s.running {
		out = append(out, &pb.ProcessInfo{Config: p.config, Pid: p.pid, Tag: p.tag})
	}
	s.mu.Unlock()
	return connect.NewResponse(&pb.ListResponse{Processes: out}), nil
}

// SendSignal implements the SendSignal RPC (SIGTERM, SIGKILL).
func (s *Service) SendSignal(ctx context.Context, req *connect.Request[pb.SendSignalRequest]) (*connect.Response[pb.SendSignalResponse], error) {
	if _, _, err := s.user(req.Header()); err != nil {
		return nil, err
	}
	var sig syscall.Signal
	switch req.Msg.GetSignal() {
	case pb.Signal_SIGNAL_SIGKILL:
		sig = syscall.SIGKILL
	case pb.Signal_SIGNAL_SIGTERM:
		sig = syscall.SIGTERM
	default:
		return nil, connect.NewError(connect.CodeInvalidArgument, fmt.Errorf("unsupported signal %v", req.Msg.GetSignal()))
	}
	p, err := s.lookupRunning(req.Msg.GetProcess())
	if err != nil {
		return nil, err
	}
	if err := p.signal(sig); err != nil {
		if errors.Is(err, os.ErrProcessDone) || errors.Is(err, syscall.ESRCH) {
			return nil, connect.NewError(connect.CodeNotFound, fmt.Errorf("process with pid %d not found", p.pid))
		}
		return nil, connect.NewError(connect.CodeInternal, fmt.Errorf("error sending signal: %w", err))
	}
	return connect.NewResponse(&pb.SendSignalResponse{}), nil
}

// SendInput implements the SendInput RPC.
func (s *Service) SendInput(ctx context.Context, req *connect.Request[pb.SendInputRequest]) (*connect.Response[pb.SendInputResponse], error) {
	if _, _, err := s.user(req.Header()); err != nil {
		return nil, err
	}
	p, err := s.lookupRunning(req.Msg.GetProcess())
	if err != nil {
		return nil, err
	}
	if err := p.write(ctx, req.Msg.GetInput()); err != nil {
		return nil, err
	}
	return connect.NewResponse(&pb.SendInputResponse{}), nil
}

// StreamInput implements the client-streaming StreamInput RPC: a start event naming the process,
// then data events; keepalives are ignored.
func (s *Service) StreamInput(ctx context.Context, stream *connect.ClientStream[pb.StreamInputRequest]) (*connect.Response[pb.StreamInputResponse], error) {
	if _, _, err := s.user(stream.RequestHeader()); err != nil {
		return nil, err
	}
	var p *proc
	for stream.Receive() {
		msg := stream.Msg()
		switch ev := msg.GetEvent().(type) {
		case *pb.StreamInputRequest_Start:
			found, err := s.lookupRunning(ev.Start.GetProcess())
			if err != nil {
				return nil, err
			}
			p = found
		case *pb.StreamInputRequest_Data:
			if p == nil {
				return nil, connect.NewError(connect.CodeFailedPrecondition, errors.New("the first message must be a start event"))
			}
			if err := p.write(ctx, ev.Data.GetInput()); err != nil {
				return nil, err
			}
		case *pb.StreamInputRequest_Keepalive:
		default:
			return nil, connect.NewError(connect.CodeInvalidArgument, errors.New("empty stream input event"))
		}
	}
	if err := stream.Err(); err != nil {
		return nil, err
	}
	return connect.NewResponse(&pb.StreamInputResponse{}), nil
}

// CloseStdin implements the CloseStdin RPC.
func (s *Service) CloseStdin(ctx context.Context, req *connect.Request[pb.CloseStdinRequest]) (*connect.Response[pb.CloseStdinResponse], error) {
	if _, _, err := s.user(req.Header()); err != nil {
		return nil, err
	}
	p, err := s.lookupRunning(req.Msg.GetProcess())
	if err != nil {
		return nil, err
	}
	if p.isPTY() {
		return nil, connect.NewError(connect.CodeFailedPrecondition, errors.New("cannot close stdin of a PTY process; send EOT (0x04) instead"))
	}
	p.ioMu.Lock()
	defer p.ioMu.Unlock()
	if p.stdin == nil {
		return nil, connect.NewError(connect.CodeFailedPrecondition, errors.New("stdin is not enabled or already closed"))
	}
	err = p.stdin.Close()
	p.stdin = nil
	if err != nil {
		return nil, connect.NewError(connect.CodeInternal, fmt.Errorf("error closing stdin: %w", err))
	}
	return connect.NewResponse(&pb.CloseStdinResponse{}), nil
}

// Update implements the Update RPC (PTY resize).
func (s *Service) Update(ctx context.Context, req *connect.Request[pb.UpdateRequest]) (*connect.Response[pb.UpdateResponse], error) {
	if _, _, err := s.user(req.Header()); err != nil {
		return nil, err
	}
	p, err := s.lookupRunning(req.Msg.GetProcess())
	if err != nil {
		return nil, err
	}
	if sz := req.Msg.GetPty().GetSize(); sz != nil {
		if !p.isPTY() {
			return nil, connect.NewError(connect.CodeFailedPrecondition, errors.New("process has no PTY"))
		}
		if sz.GetCols() == 0 || sz.GetRows() == 0 {
			return nil, connect.NewError(connect.CodeInvalidArgument, errors.New("pty size must be positive"))
		}
		p.ioMu.Lock()
		err := setSize(p.pty, clampU16(sz.GetCols()), clampU16(sz.GetRows()))
		p.ioMu.Unlock()
		if err != nil {
			return nil, connect.NewError(connect.CodeInternal, fmt.Errorf("error resizing pty: %w", err))
		}
	}
	return connect.NewResponse(&pb.UpdateResponse{}), nil
}

// SignalAll sends sig to every running process group (PID 1 signal forwarding).
func (s *Service) SignalAll(sig syscall.Signal) int {
	s.mu.Lock()
	procs := make([]*proc, 0, len(s.running))
	for _, p := range s.running {
		procs = append(procs, p)
	}
	s.mu.Unlock()
	for _, p := range procs {
		_ = p.signal(sig)
	}
	return len(procs)
}

// Running is the number of running processes.
func (s *Service) Running() int {
	s.mu.Lock()
	defer s.mu.Unlock()
	return len(s.running)
}

// write sends input to the process's stdin pipe or PTY.
func (p *proc) write(ctx context.Context, in *pb.ProcessInput) error {
	var data []byte
	var f *os.File
	p.ioMu.Lock()
	defer p.ioMu.Unlock()
	switch v := in.GetInput().(type) {
	case *pb.ProcessInput_Stdin:
		data = v.Stdin
		f = p.stdin
		if f == nil && p.pty != nil {
			f = p.pty
		}
		if f == nil {
			return connect.NewError(connect.CodeFailedPrecondition, errors.New("stdin is not enabled or already closed"))
		}
	case *pb.ProcessInput_Pty:
		data = v.Pty
		if p.pty == nil {
			return connect.NewError(connect.CodeFailedPrecondition, errors.New("process has no PTY"))
		}
		f = p.pty
	default:
		return connect.NewError(connect.CodeInvalidArgument, errors.New("input (stdin or pty) is required"))
	}
	dl, ok := ctx.Deadline()
	if !ok {
		dl = time.Now().Add(60 * time.Second) // never block forever on a process that does not read
	}
	_ = f.SetWriteDeadline(dl)
	if _, err := f.Write(data); err != nil {
		if errors.Is(err, os.ErrDeadlineExceeded) {
			return connect.NewError(connect.CodeDeadlineExceeded, errors.New("process is not reading its input"))
		}
		if errors.Is(err, syscall.EPIPE) || errors.Is(err, os.ErrClosed) {
			return connect.NewError(connect.CodeFailedPrecondition, fmt.Errorf("input closed: %w", err))
		}
		return connect.NewError(connect.CodeInternal, fmt.Errorf("error writing input: %w", err))
	}
	return nil
}
