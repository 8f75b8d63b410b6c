package mock

import (
	"encoding/json"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"strconv"
	"sync"
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

	mu    sync.Mutex
	inits []InitRequest
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
	e.srv = httptest.NewServer(mux)
	return e
}

// Inits returns the init requests received so far.
func (e *Envd) Inits() []InitRequest {
	e.mu.Lock()
	defer e.mu.Unlock()
	return append([]InitRequest(nil), e.inits...)
}

func (e *Envd) hostPort() (string, int) {
	host, port, _ := net.SplitHostPort(e.srv.Listener.Addr().String())
	p, _ := strconv.Atoi(port)
	return host, p
}

func (e *Envd) close() { e.srv.Close() }
