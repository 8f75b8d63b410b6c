package mock

import (
	"context"
	"encoding/json"
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
	// HeaderToken is the X-Access-Token header of the request (not part of the body).
	HeaderToken string `json:"-"`
}

// Envd is a fake in-sandbox daemon on a loopback httptest server: it answers
// GET /health and POST /init the way envd does, records init bodies, and fails on
// demand through the owning backend's hooks.
type Envd struct {
	srv  *httptest.Server
	hook func(Stage) error

	mu     sync.Mutex
	inits  []InitRequest
	starts []StartRequest
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

// processService answers Start with a start event and records the request; the other
// RPCs are unimplemented (the orchestrator only starts template start commands).
type processService struct {
	processconnect.UnimplementedProcessHandler
	e *Envd
}

func (p processService) Start(_ context.Context, req *connect.Request[processpb.StartRequest], stream *connect.ServerStream[processpb.StartResponse]) error {
	cfg := req.Msg.GetProcess()
	p.e.mu.Lock()
	p.e.starts = append(p.e.starts, StartRequest{
		Cmd: cfg.GetCmd(), Args: cfg.GetArgs(), Cwd: cfg.GetCwd(), Tag: req.Msg.GetTag(),
		Authorization: req.Header().Get("Authorization"), AccessToken: req.Header().Get("X-Access-Token"),
	})
	pid := uint32(len(p.e.starts))
	p.e.mu.Unlock()
	// Then one line of output on each stream and a clean exit, so output capture can be
	// tested.
	events := []*processpb.ProcessEvent{
		{Event: &processpb.ProcessEvent_Start{Start: &processpb.ProcessEvent_StartEvent{Pid: pid}}},
		{Event: &processpb.ProcessEvent_Data{Data: &processpb.ProcessEvent_DataEvent{
			Output: &processpb.ProcessEvent_DataEvent_Stdout{Stdout: []byte("out of " + strings.Join(cfg.GetArgs(), " ") + "\n")}}}},
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

func newEnvd(hook func(Stage) error) *Envd {
	e := &Envd{hook: hook}
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

func (e *Envd) close() { e.srv.Close() }
