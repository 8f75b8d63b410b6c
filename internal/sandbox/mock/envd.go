package mock

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"strconv"
	"strings"
	"sync"

	"connectrpc.com/connect"

	processpb "github.com/aenv-dev/aenv/internal/envd/gen/process"
	"github.com/aenv-dev/aenv/internal/envd/gen/process/processconnect"
)

// EnvdVersion is what the fake envd reports in X-Envd-Version.
const EnvdVersion = "0.5.15"

// InitRequest is one decoded POST /init body with the token header it came with.
type InitRequest struct {
	EnvVars        map[string]string `json:"envVars"`
	AccessToken    string            `json:"accessToken"`
	DefaultUser    string            `json:"defaultUser"`
	DefaultWorkdir string            `json:"defaultWorkdir"`
	Timestamp      string            `json:"timestamp"`
	Entropy        []byte            `json:"entropy"`
	// HeaderToken is the X-Access-Token header of the request (not part of the body).
	HeaderToken string `json:"-"`
}

// Envd is a fake in-sandbox daemon on a loopback httptest server: it answers
// GET /health and POST /init the way envd does, records init bodies, and fails on
// demand through the owning backend's hooks.
type Envd struct {
	srv  *httptest.Server
	hook func(Stage) error
	hold bool
	quit chan struct{} // closed when the instance stops: held streams end

	mu       sync.Mutex
	inits    []InitRequest
	starts   []StartRequest
	procs    map[uint32]*fakeProc
	connects []ConnectRequest
}

// fakeProc is a held process: its events go to the streams attached to it.
type fakeProc struct {
	tag  string
	end  *processpb.ProcessEvent // set once ended
	subs map[chan *processpb.ProcessEvent]bool
}

// ConnectRequest is one process.Process/Connect call: the selector it named.
type ConnectRequest struct {
	Pid uint32
	Tag string
}

// StartRequest is one process.Process/Start call the fake envd received.
type StartRequest struct {
	Cmd           string
	Args          []string
	Cwd           string
	Tag           string
	Authorization string
	AccessToken   string
}

// processService answers Start with a start event and records the request, and Connect
// for held processes (Options.HoldStartCommands); the other RPCs are unimplemented (the
// orchestrator only starts and re-attaches to template start commands).
type processService struct {
	processconnect.UnimplementedProcessHandler
	e *Envd
}

func (p processService) Start(ctx context.Context, req *connect.Request[processpb.StartRequest], stream *connect.ServerStream[processpb.StartResponse]) error {
	cfg := req.Msg.GetProcess()
	p.e.mu.Lock()
	p.e.starts = append(p.e.starts, StartRequest{
		Cmd: cfg.GetCmd(), Args: cfg.GetArgs(), Cwd: cfg.GetCwd(), Tag: req.Msg.GetTag(),
		Authorization: req.Header().Get("Authorization"), AccessToken: req.Header().Get("X-Access-Token"),
	})
	pid := uint32(len(p.e.starts))
	p.e.mu.Unlock()
	out := []byte("out of " + strings.Join(cfg.GetArgs(), " ") + "\n")
	if p.e.hold {
		return p.e.serveHeld(ctx, pid, req.Msg.GetTag(), out,
			func(ev *processpb.ProcessEvent) error { return stream.Send(&processpb.StartResponse{Event: ev}) })
	}
	// Then one line of output on each stream and a clean exit, so output capture can be
	// tested.
	events := []*processpb.ProcessEvent{
		{Event: &processpb.ProcessEvent_Start{Start: &processpb.ProcessEvent_StartEvent{Pid: pid}}},
		dataEvent(out),
		{Event: &processpb.ProcessEvent_Data{Data: &processpb.ProcessEvent_DataEvent{
			Output: &processpb.ProcessEvent_DataEvent_Stderr{Stderr: []byte("err line")}}}},
		{Event: &processpb.ProcessEvent_End{End: &processpb.ProcessEvent_EndEvent{ExitCode: 0, Exited: true, Status: "exit status 0"}}},
	}
	for _, ev := range events {
		if err := stream.Send(&processpb.StartResponse{Event: ev}); err != nil {
			return err
		}
	}
	return nil
}

// Connect re-attaches to a held process by pid or tag: start, then its events from now
// on; a process that ended gets start and end.
func (p processService) Connect(ctx context.Context, req *connect.Request[processpb.ConnectRequest], stream *connect.ServerStream[processpb.ConnectResponse]) error {
	sel := ConnectRequest{Pid: req.Msg.GetProcess().GetPid(), Tag: req.Msg.GetProcess().GetTag()}
	p.e.mu.Lock()
	var pid uint32
	for id, fp := range p.e.procs {
		if (sel.Pid != 0 && id == sel.Pid) || (sel.Pid == 0 && fp.tag == sel.Tag && id > pid) {
			pid = id
		}
	}
	p.e.connects = append(p.e.connects, sel)
	p.e.mu.Unlock()
	if pid == 0 {
		return connect.NewError(connect.CodeNotFound, fmt.Errorf("process %+v not found", sel))
	}
	return p.e.serveHeld(ctx, pid, "", nil, func(ev *processpb.ProcessEvent) error {
		return stream.Send(&processpb.ConnectResponse{Event: ev})
	})
}

// serveHeld sends a held process's start event (creating it on first use with out as
// its first output), then its events until it ends, the client goes (the process runs
// on, as a tagged one does in envd) or the instance stops.
func (e *Envd) serveHeld(ctx context.Context, pid uint32, tag string, out []byte, send func(*processpb.ProcessEvent) error) error {
	ch := make(chan *processpb.ProcessEvent, 16)
	e.mu.Lock()
	fp := e.procs[pid]
	if fp == nil {
		fp = &fakeProc{tag: tag, subs: map[chan *processpb.ProcessEvent]bool{}}
		e.procs[pid] = fp
	}
	end := fp.end
	if end == nil {
		fp.subs[ch] = true
		defer func() {
			e.mu.Lock()
			delete(fp.subs, ch)
			e.mu.Unlock()
		}()
	}
	e.mu.Unlock()
	if err := send(&processpb.ProcessEvent{Event: &processpb.ProcessEvent_Start{Start: &processpb.ProcessEvent_StartEvent{Pid: pid}}}); err != nil {
		return err
	}
	if end != nil {
		return send(end)
	}
	if out != nil {
		if err := send(dataEvent(out)); err != nil {
			return err
		}
	}
	for {
		select {
		case ev := <-ch:
			if err := send(ev); err != nil || ev.GetEnd() != nil {
				return err
			}
		case <-ctx.Done():
			return ctx.Err()
		case <-e.quit:
			return nil
		}
	}
}

func dataEvent(stdout []byte) *processpb.ProcessEvent {
	return &processpb.ProcessEvent{Event: &processpb.ProcessEvent_Data{Data: &processpb.ProcessEvent_DataEvent{
		Output: &processpb.ProcessEvent_DataEvent_Stdout{Stdout: stdout}}}}
}

// Emit writes stdout to held process pid: the streams attached to it now get it (like
// envd, the fake keeps no backlog for streams that attach later).
func (e *Envd) Emit(pid uint32, stdout string) { e.publish(pid, dataEvent([]byte(stdout)), false) }

// End ends held process pid with exit code.
func (e *Envd) End(pid uint32, code int32) {
	e.publish(pid, &processpb.ProcessEvent{Event: &processpb.ProcessEvent_End{End: &processpb.ProcessEvent_EndEvent{
		ExitCode: code, Exited: true, Status: fmt.Sprintf("exit status %d", code)}}}, true)
}

func (e *Envd) publish(pid uint32, ev *processpb.ProcessEvent, end bool) {
	e.mu.Lock()
	defer e.mu.Unlock()
	fp := e.procs[pid]
	if fp == nil || fp.end != nil {
		return
	}
	if end {
		fp.end = ev
	}
	for ch := range fp.subs {
		select {
		case ch <- ev:
		default: // a stream too slow for 16 events loses them, as a test would notice
		}
	}
}

// Attached returns how many streams are attached to held process pid.
func (e *Envd) Attached(pid uint32) int {
	e.mu.Lock()
	defer e.mu.Unlock()
	if fp := e.procs[pid]; fp != nil {
		return len(fp.subs)
	}
	return 0
}

// Connects returns the Connect calls received so far.
func (e *Envd) Connects() []ConnectRequest {
	e.mu.Lock()
	defer e.mu.Unlock()
	return append([]ConnectRequest(nil), e.connects...)
}

func newEnvd(hook func(Stage) error, hold bool) *Envd {
	e := &Envd{hook: hook, hold: hold, quit: make(chan struct{}), procs: map[uint32]*fakeProc{}}
	mux := http.NewServeMux()
	mux.HandleFunc("GET /health", func(w http.ResponseWriter, r *http.Request) {
		if err := e.hook(StageEnvdHealth); err != nil {
			http.Error(w, err.Error(), http.StatusServiceUnavailable)
			return
		}
		w.Header().Set("Cache-Control", "no-store")
		w.WriteHeader(http.StatusNoContent)
	})
	mux.HandleFunc("POST /init", func(w http.ResponseWriter, r *http.Request) {
		body, err := io.ReadAll(r.Body)
		if err != nil {
			http.Error(w, err.Error(), http.StatusBadRequest)
			return
		}
		var req InitRequest
		if err := json.Unmarshal(body, &req); err != nil {
			http.Error(w, "bad init body: "+err.Error(), http.StatusBadRequest)
			return
		}
		req.HeaderToken = r.Header.Get("X-Access-Token")
		if err := e.hook(StageEnvdInit); err != nil {
			http.Error(w, err.Error(), http.StatusInternalServerError)
			return
		}
		e.mu.Lock()
		e.inits = append(e.inits, req)
		e.mu.Unlock()
		w.Header().Set("X-Envd-Version", EnvdVersion)
		w.WriteHeader(http.StatusNoContent)
	})
	path, handler := processconnect.NewProcessHandler(processService{e: e})
	mux.Handle(path, handler)
	e.srv = httptest.NewServer(mux)
	return e
}

// Inits returns the init requests received so far.
func (e *Envd) Inits() []InitRequest {
	e.mu.Lock()
	defer e.mu.Unlock()
	return append([]InitRequest(nil), e.inits...)
}

// Starts returns the process starts received so far.
func (e *Envd) Starts() []StartRequest {
	e.mu.Lock()
	defer e.mu.Unlock()
	return append([]StartRequest(nil), e.starts...)
}

func (e *Envd) hostPort() (string, int) {
	host, port, _ := net.SplitHostPort(e.srv.Listener.Addr().String())
	p, _ := strconv.Atoi(port)
	return host, p
}

func (e *Envd) close() {
	close(e.quit)
	e.srv.Close()
}
