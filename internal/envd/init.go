package envd

import (
	"encoding/json"
	"errors"
	"io"
	"net/http"
	"os"
	"path/filepath"
	"time"

	"golang.org/x/sys/unix"

	"github.com/aenv-dev/aenv/internal/envd/files"
	"github.com/aenv-dev/aenv/internal/envd/state"
	"github.com/aenv-dev/aenv/internal/sandbox"
)

// InitRequest is the body of POST /init as the orchestrator sends it (E2B's shape). volumeMounts,
// hyperloopIP, lifecycleID and caBundle are accepted and ignored. Entropy is aenv's own:
// fresh random bytes for a sandbox whose memory came from a capture (reseedRandom).
type InitRequest struct {
	EnvVars        map[string]string `json:"envVars,omitempty"`
	AccessToken    *string           `json:"accessToken,omitempty"`
	Timestamp      *time.Time        `json:"timestamp,omitempty"`
	DefaultUser    *string           `json:"defaultUser,omitempty"`
	DefaultWorkdir *string           `json:"defaultWorkdir,omitempty"`
	Entropy        []byte            `json:"entropy,omitempty"`
}

// init applies an InitRequest. Once a token is set, re-initialising needs it in X-Access-Token.
// A body whose timestamp is older than the last applied one changes nothing.
func (s *Server) init(w http.ResponseWriter, r *http.Request) {
	if r.Method != http.MethodPost {
		files.Error(w, http.StatusMethodNotAllowed, "method not allowed")
		return
	}
	if !s.tokenOK(r) {
		files.Error(w, http.StatusUnauthorized, "missing or invalid access token")
		return
	}
	var req InitRequest
	dec := json.NewDecoder(io.LimitReader(r.Body, 8<<20))
	if err := dec.Decode(&req); err != nil && !errors.Is(err, io.EOF) {
		files.Error(w, http.StatusBadRequest, "invalid init body: "+err.Error())
		return
	}
	if req.DefaultUser != nil && *req.DefaultUser != "" {
		if _, err := s.cfg.Users.Lookup(*req.DefaultUser); err != nil {
			files.Error(w, http.StatusBadRequest, "invalid defaultUser: "+err.Error())
			return
		}
	}
	if len(req.Entropy) > 0 {
		// Whatever the timestamp: fresh entropy is never stale. A sandbox that would
		// share its random numbers with its siblings is not made, and a failed /init
		// changes nothing, so this comes before the defaults.
		if err := reseedRandom(s.cfg.RandomDevice, req.Entropy); err != nil {
			files.Error(w, http.StatusInternalServerError, err.Error())
			return
		}
	}
	in := state.Init{EnvVars: req.EnvVars, AccessToken: req.AccessToken, DefaultUser: req.DefaultUser, DefaultWorkdir: req.DefaultWorkdir}
	if req.Timestamp != nil {
		in.Timestamp = *req.Timestamp
	}
	applied := s.defaults.Apply(in)
	if applied && s.cfg.SetClock && req.Timestamp != nil {
		s.setClock(*req.Timestamp)
	}
	if applied && s.cfg.RunDir != "" {
		for _, k := range []string{"E2B_SANDBOX_ID", "E2B_TEMPLATE_ID"} {
			if v, ok := req.EnvVars[k]; ok {
				_ = os.MkdirAll(s.cfg.RunDir, 0o755)
				_ = os.WriteFile(filepath.Join(s.cfg.RunDir, "."+k), []byte(v), 0o644)
			}
		}
	}
	if applied && s.cfg.SetHostname {
		s.setHostname(req.EnvVars["E2B_SANDBOX_ID"])
	}
	if applied && s.cfg.HostsFile != "" {
		// After a restore or a fork the host name is the new sandbox's.
		if name, err := os.Hostname(); err == nil {
			if err := ensureHostsEntry(s.cfg.HostsFile, name); err != nil {
				s.cfg.Logger.Warn("envd: add the host name to the hosts file", "path", s.cfg.HostsFile, "err", err)
			}
		}
	}
	w.Header().Set("X-Envd-Version", Version)
	w.Header().Set("Cache-Control", "no-store")
	w.WriteHeader(http.StatusNoContent)
}

// setHostname makes the host name the one the backends give sandbox id, unless id is
// empty or that is already the name.
func (s *Server) setHostname(id string) {
	name := sandbox.Hostname(id)
	if cur, err := os.Hostname(); name == "" || err == nil && cur == name {
		return
	}
	if err := unix.Sethostname([]byte(name)); err != nil {
		s.cfg.Logger.Warn("envd: set the host name", "name", name, "err", err)
	}
}

// setClock moves the system clock forward to ts when it is behind. It never moves it back:
// ts was taken before the request was sent, so a clock that is ahead by less than the
// request's latency is right.
func (s *Server) setClock(ts time.Time) {
	now := time.Now()
	if !ts.After(now) {
		return
	}
	tv := unix.NsecToTimeval(ts.UnixNano())
	if err := unix.Settimeofday(&tv); err != nil {
		s.cfg.Logger.Warn("envd: set clock", "behind", ts.Sub(now), "err", err)
		return
	}
	s.cfg.Logger.Info("envd: clock set", "was_behind", ts.Sub(now))
}
