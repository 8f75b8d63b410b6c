package build

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/url"
	"time"

	"github.com/aenv-dev/aenv/internal/envdclient"
)

// Session is a connection to the envd of one build sandbox. Steps, the ready check and
// the tar capture all run through it, so the builder works on any sandbox backend that
// runs envd.
type Session struct {
	SandboxID string
	base      string
	token     string
	http      *http.Client
	envd      *envdclient.Client
}

// NewSession connects to envd at base ("http://host:port") with the sandbox's access token.
func NewSession(sandboxID, base, token string, hc *http.Client) *Session {
	if hc == nil {
		hc = &http.Client{}
	}
	s := &Session{SandboxID: sandboxID, base: base, token: token, http: hc}
	s.envd = envdclient.New(hc, base, envdclient.WithAccessToken(token))
	return s
}

// Command is one process to run in the build sandbox.
type Command struct {
	// Script runs as `/bin/bash -l -c Script`, the way the SDKs run commands.
	Script string
	// Argv, when set, is run directly instead of Script (for images without bash).
	Argv []string
	User string
	Dir  string
	Env  map[string]string
	// Stdout and Stderr receive the output as it arrives; nil discards it.
	Stdout, Stderr io.Writer
}

// ErrExit is wrapped by Run when the command ran and exited with a non-zero status.
var ErrExit = errors.New("command failed")

// ExitError carries the exit code of a failed command.
type ExitError struct {
	Code   int
	Status string
}

func (e *ExitError) Error() string {
	if e.Status != "" {
		return fmt.Sprintf("exit code %d (%s)", e.Code, e.Status)
	}
	return fmt.Sprintf("exit code %d", e.Code)
}

func (e *ExitError) Unwrap() error { return ErrExit }

// Run runs c and waits for it. A non-zero exit is an *ExitError; ctx ending kills the
// remote process (envd kills it when the stream's deadline or cancellation arrives).
func (s *Session) Run(ctx context.Context, c Command) error {
	cmd, args := "/bin/bash", []string{"-l", "-c", c.Script}
	if len(c.Argv) > 0 {
		cmd, args = c.Argv[0], c.Argv[1:]
	}
	p, err := s.envd.Start(ctx, envdclient.Command{Cmd: cmd, Args: args, Cwd: c.Dir, User: c.User, Env: c.Env})
	if errors.Is(err, envdclient.ErrNoStart) {
		// Before the start event the stream ending reads as any other missing end event.
		return fmt.Errorf("run %q: stream ended without an end event", c.describe())
	}
	var recvErr *envdclient.ReceiveError
	if errors.As(err, &recvErr) {
		return fmt.Errorf("run %q: %w", c.describe(), recvErr.Err)
	}
	if err != nil {
		return fmt.Errorf("start %q: %w", c.describe(), err)
	}
	defer p.Close()
	end, err := p.Wait(c.Stdout, c.Stderr)
	if errors.Is(err, envdclient.ErrNoEnd) {
		return fmt.Errorf("run %q: stream ended without an end event", c.describe())
	}
	if err != nil {
		return fmt.Errorf("run %q: %w", c.describe(), err)
	}
	if end.GetExitCode() != 0 || !end.GetExited() {
		return &ExitError{Code: int(end.GetExitCode()), Status: end.GetStatus()}
	}
	return nil
}

func (c Command) describe() string {
	if len(c.Argv) > 0 {
		return c.Argv[0]
	}
	if len(c.Script) > 60 {
		return c.Script[:60] + "..."
	}
	return c.Script
}

// Upload writes r to path in the sandbox as user (envd POST /files, raw body).
func (s *Session) Upload(ctx context.Context, path, user string, r io.Reader) error {
	q := url.Values{"path": {path}}
	if user != "" {
		q.Set("username", user)
	}
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, s.base+"/files?"+q.Encode(), r)
	if err != nil {
		return err
	}
	req.Header.Set("Content-Type", "application/octet-stream")
	if s.token != "" {
		req.Header.Set("X-Access-Token", s.token)
	}
	resp, err := s.http.Do(req)
	if err != nil {
		return fmt.Errorf("upload %s: %w", path, err)
	}
	defer resp.Body.Close()
	if resp.StatusCode/100 != 2 {
		msg, _ := io.ReadAll(io.LimitReader(resp.Body, 4096))
		return fmt.Errorf("upload %s: status %d: %s", path, resp.StatusCode, msg)
	}
	return nil
}

// Download reads path from the sandbox as root (envd GET /files).
func (s *Session) Download(ctx context.Context, path string) ([]byte, error) {
	q := url.Values{"path": {path}, "username": {"root"}}
	ctx, cancel := context.WithTimeout(ctx, time.Minute)
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, s.base+"/files?"+q.Encode(), nil)
	if err != nil {
		return nil, err
	}
	if s.token != "" {
		req.Header.Set("X-Access-Token", s.token)
	}
	resp, err := s.http.Do(req)
	if err != nil {
		return nil, fmt.Errorf("download %s: %w", path, err)
	}
	defer resp.Body.Close()
	body, err := io.ReadAll(io.LimitReader(resp.Body, 16<<20))
	if err != nil {
		return nil, fmt.Errorf("download %s: %w", path, err)
	}
	if resp.StatusCode/100 != 2 {
		return nil, fmt.Errorf("download %s: status %d: %s", path, resp.StatusCode, body)
	}
	return body, nil
}
