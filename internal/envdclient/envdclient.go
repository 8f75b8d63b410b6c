// Package envdclient talks to an envd's process service from Go: the CLI, the template
// builder, the orchestrator and the benchmark all start commands in sandboxes the same way
// and differ only in how they reach envd (directly, or through a node's proxy that routes
// by headers) and in how they judge the end of a command.
package envdclient

import (
	"context"
	"encoding/base64"
	"errors"
	"io"
	"net/http"

	"connectrpc.com/connect"

	"github.com/aenv-dev/aenv/internal/envd/gen/process"
	"github.com/aenv-dev/aenv/internal/envd/gen/process/processconnect"
)

// ErrNoStart is returned by Start when envd closed the stream before the start event.
var ErrNoStart = errors.New("envd closed the stream before the process started")

// ErrNoEnd is returned by Wait when the stream ended without an end event (the sandbox
// may have stopped).
var ErrNoEnd = errors.New("stream ended without an end event")

// ReceiveError is an error Start met reading the event stream, after envd accepted the
// call; callers word it as a failure of the running command, not of its start. Error is
// the underlying error's text, and connect.CodeOf sees through it.
type ReceiveError struct{ Err error }

func (e *ReceiveError) Error() string { return e.Err.Error() }

func (e *ReceiveError) Unwrap() error { return e.Err }

// Client is a process client of one envd whose every RPC carries the configured headers.
type Client struct {
	// Proc is the underlying client, for the RPCs Start does not wrap (signals, input,
	// PTY resizes); it sends the same headers.
	Proc        processconnect.ProcessClient
	token       string
	sandboxID   string
	sandboxPort string
	json        bool
}

// Option configures a Client.
type Option func(*Client)

// WithAccessToken sends the sandbox's envd access token; envd refuses RPCs without it
// once a token is set. An empty token sends nothing.
func WithAccessToken(token string) Option { return func(c *Client) { c.token = token } }

// WithSandbox names the sandbox and port for a node's proxy, which routes envd traffic by
// these headers (as the SDKs do in single-server mode) rather than by the URL.
func WithSandbox(id, port string) Option {
	return func(c *Client) { c.sandboxID, c.sandboxPort = id, port }
}

// WithJSON speaks Connect's JSON encoding instead of binary protobuf, as the E2B SDKs do
// (envd decodes and encodes the two with different code).
func WithJSON() Option { return func(c *Client) { c.json = true } }

// New returns a client of the envd (or node proxy) at baseURL.
func New(hc connect.HTTPClient, baseURL string, opts ...Option) *Client {
	c := &Client{}
	for _, o := range opts {
		o(c)
	}
	c.Proc = processconnect.NewProcessClient(hc, baseURL, c.ClientOptions()...)
	return c
}

// ClientOptions are the Connect options of the client's calls (headers, encoding), for
// other Connect clients of the same envd (the filesystem service).
func (c *Client) ClientOptions() []connect.ClientOption {
	opts := []connect.ClientOption{connect.WithInterceptors(c.Interceptor())}
	if c.json {
		opts = append(opts, connect.WithProtoJSON())
	}
	return opts
}

// Interceptor adds the client's headers to every call, for other Connect clients of the
// same envd (the filesystem service).
func (c *Client) Interceptor() connect.Interceptor { return headerInterceptor{c} }

// SetHeaders adds the client's headers to h, for envd's plain HTTP endpoints (/files).
func (c *Client) SetHeaders(h http.Header) {
	if c.sandboxID != "" {
		h.Set("E2b-Sandbox-Id", c.sandboxID)
		h.Set("E2b-Sandbox-Port", c.sandboxPort)
	}
	if c.token != "" {
		h.Set("X-Access-Token", c.token)
	}
}

type headerInterceptor struct{ c *Client }

func (i headerInterceptor) WrapUnary(next connect.UnaryFunc) connect.UnaryFunc {
	return func(ctx context.Context, req connect.AnyRequest) (connect.AnyResponse, error) {
		i.c.SetHeaders(req.Header())
		return next(ctx, req)
	}
}

func (i headerInterceptor) WrapStreamingClient(next connect.StreamingClientFunc) connect.StreamingClientFunc {
	return func(ctx context.Context, spec connect.Spec) connect.StreamingClientConn {
		conn := next(ctx, spec)
		i.c.SetHeaders(conn.RequestHeader())
		return conn
	}
}

func (i headerInterceptor) WrapStreamingHandler(next connect.StreamingHandlerFunc) connect.StreamingHandlerFunc {
	return next
}

// BasicUser is the Authorization value that makes envd run a process as user: envd takes
// the user name from HTTP Basic auth with an empty password.
func BasicUser(user string) string {
	return "Basic " + base64.StdEncoding.EncodeToString([]byte(user+":"))
}

// Command is one process to start.
type Command struct {
	Cmd  string
	Args []string
	// Cwd, User and Tag are left to envd's defaults when empty.
	Cwd  string
	User string
	Tag  string
	Env  map[string]string
	// Stdin keeps the process's stdin open for SendInput; without it the process reads EOF.
	Stdin bool
	// PTY, when set, runs the process on a terminal of that size.
	PTY *process.PTY
}

// Process is a started (or re-attached) process whose event stream is still open.
type Process struct {
	Pid    uint32
	stream eventStream
}

// eventStream is what Process reads: the event streams of Start and Connect differ only
// in their message type.
type eventStream interface {
	Receive() bool
	event() *process.ProcessEvent
	Err() error
	Close() error
}

type startStream struct {
	*connect.ServerStreamForClient[process.StartResponse]
}

func (s startStream) event() *process.ProcessEvent { return s.Msg().GetEvent() }

type connectStream struct {
	*connect.ServerStreamForClient[process.ConnectResponse]
}

func (s connectStream) event() *process.ProcessEvent { return s.Msg().GetEvent() }

// Start starts c and returns once envd reports its pid. Errors of the call are returned
// as they are and those of the stream as a *ReceiveError, so callers can read their
// connect code and add their own context. The process
// stops when ctx ends unless envd keeps it (tagged processes outlive their stream).
func (c *Client) Start(ctx context.Context, cmd Command) (*Process, error) {
	stdin := cmd.Stdin
	req := connect.NewRequest(&process.StartRequest{
		Process: &process.ProcessConfig{Cmd: cmd.Cmd, Args: cmd.Args, Envs: cmd.Env},
		Stdin:   &stdin,
		Pty:     cmd.PTY,
	})
	if cmd.Cwd != "" {
		req.Msg.Process.Cwd = &cmd.Cwd
	}
	if cmd.Tag != "" {
		req.Msg.Tag = &cmd.Tag
	}
	if cmd.User != "" {
		req.Header().Set("Authorization", BasicUser(cmd.User))
	}
	stream, err := c.Proc.Start(ctx, req)
	if err != nil {
		return nil, err
	}
	return awaitStart(startStream{stream})
}

// Selector names a process envd runs (or finished recently): by Pid when non-zero,
// else by Tag.
type Selector struct {
	Pid uint32
	Tag string
}

// Connect re-attaches to a process envd started earlier, as E2B's process.Connect does,
// and returns once envd reports its pid. Output written before the call is not replayed;
// a process that already finished yields its end event at once. Errors are as Start's:
// a process envd does not know is connect.CodeNotFound.
func (c *Client) Connect(ctx context.Context, sel Selector) (*Process, error) {
	ps := &process.ProcessSelector{}
	switch {
	case sel.Pid != 0:
		ps.Selector = &process.ProcessSelector_Pid{Pid: sel.Pid}
	case sel.Tag != "":
		ps.Selector = &process.ProcessSelector_Tag{Tag: sel.Tag}
	default:
		return nil, ErrNoSelector
	}
	stream, err := c.Proc.Connect(ctx, connect.NewRequest(&process.ConnectRequest{Process: ps}))
	if err != nil {
		return nil, err
	}
	return awaitStart(connectStream{stream})
}

// ErrNoSelector is returned by Connect when the selector names no process.
var ErrNoSelector = errors.New("process selector needs a pid or a tag")

// awaitStart reads the stream up to the start event.
func awaitStart(stream eventStream) (*Process, error) {
	for stream.Receive() {
		if st := stream.event().GetStart(); st != nil {
			return &Process{Pid: st.GetPid(), stream: stream}, nil
		}
	}
	err := stream.Err()
	stream.Close()
	if err != nil {
		return nil, &ReceiveError{Err: err}
	}
	return nil, ErrNoStart
}

// Wait copies the output to stdout and stderr as it arrives (PTY output goes to stdout;
// a nil writer discards) and returns the end event, which callers judge differently:
// a signal leaves Exited false. It returns ErrNoEnd if the stream ends first.
func (p *Process) Wait(stdout, stderr io.Writer) (*process.ProcessEvent_EndEvent, error) {
	for p.stream.Receive() {
		ev := p.stream.event()
		if d := ev.GetData(); d != nil {
			write(stdout, d.GetStdout())
			write(stderr, d.GetStderr())
			write(stdout, d.GetPty())
			continue
		}
		if end := ev.GetEnd(); end != nil {
			return end, nil
		}
	}
	if err := p.stream.Err(); err != nil {
		return nil, err
	}
	return nil, ErrNoEnd
}

func write(w io.Writer, b []byte) {
	if w != nil && len(b) > 0 {
		_, _ = w.Write(b)
	}
}

// Close closes the event stream; a tagged process keeps running.
func (p *Process) Close() error { return p.stream.Close() }
