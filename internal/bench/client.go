package bench

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/url"
	"strings"
	"time"

	"github.com/aenv-dev/aenv/internal/envdclient"
)

// envdPort is the port the node's proxy forwards envd traffic to (E2b-Sandbox-Port).
const envdPort = "49983"

// Client reaches one aenv node: REST for the lifecycle, envd through the node's proxy the
// way the SDKs do in single-server mode (the sandbox named by headers, not by the path).
type Client struct {
	base string
	key  string
	http *http.Client
}

// NewClient returns a client of the node at base (http://host:port) with API key key.
// conns is how many connections to the node are kept open, at least the concurrency the
// client is used with, so a measurement does not pay for TCP handshakes.
func NewClient(base, key string, conns int) *Client {
	tr := &http.Transport{
		DialContext:         (&net.Dialer{Timeout: 10 * time.Second}).DialContext,
		MaxIdleConns:        max(conns, 2) * 2,
		MaxIdleConnsPerHost: max(conns, 2) * 2,
		IdleConnTimeout:     90 * time.Second,
	}
	c := &Client{base: strings.TrimRight(base, "/"), key: key, http: &http.Client{Transport: tr}}
	return c
}

// Close drops the idle connections.
func (c *Client) Close() { c.http.CloseIdleConnections() }

// Sandbox is what a create returns that later calls need.
type Sandbox struct {
	ID    string `json:"sandboxID"`
	Token string `json:"envdAccessToken"`
}

// APIError is a non-2xx answer of the node.
type APIError struct {
	Op      string
	Status  int
	Message string
}

func (e *APIError) Error() string {
	return fmt.Sprintf("%s: HTTP %d: %s", e.Op, e.Status, e.Message)
}

// CreateRequest is the subset of POST /v2/sandboxes the benchmarks set.
type CreateRequest struct {
	TemplateID string `json:"templateID"`
	// Timeout in seconds: a sandbox a crashed benchmark leaves behind expires by itself.
	Timeout  int  `json:"timeout,omitempty"`
	Secure   bool `json:"secure"`
	MemoryMB int  `json:"memoryMB,omitempty"`
	CPUCount int  `json:"cpuCount,omitempty"`
}

// Create creates a sandbox with POST /v2/sandboxes, as the SDKs do.
func (c *Client) Create(ctx context.Context, r CreateRequest) (Sandbox, error) {
	var sb Sandbox
	err := c.do(ctx, "create sandbox", http.MethodPost, "/v2/sandboxes", r, http.StatusCreated, &sb)
	if err == nil && sb.ID == "" {
		err = errors.New("create sandbox: answer has no sandboxID")
	}
	return sb, err
}

// Kill deletes a sandbox. A sandbox that is already gone is not an error.
func (c *Client) Kill(ctx context.Context, id string) error {
	err := c.do(ctx, "kill "+id, http.MethodDelete, "/sandboxes/"+id, nil, http.StatusNoContent, nil)
	var ae *APIError
	if errors.As(err, &ae) && ae.Status == http.StatusNotFound {
		return nil
	}
	return err
}

// Pause pauses a sandbox (POST /sandboxes/{id}/pause), leaving memory to the node's default.
func (c *Client) Pause(ctx context.Context, id string) error {
	return c.do(ctx, "pause "+id, http.MethodPost, "/sandboxes/"+id+"/pause", nil, http.StatusNoContent, nil)
}

// PauseToDisk pauses a sandbox with {"memory": false}: its filesystem is captured and it
// releases everything else; a connect restarts its processes on the files.
func (c *Client) PauseToDisk(ctx context.Context, id string) error {
	body := map[string]bool{"memory": false}
	return c.do(ctx, "pause "+id+" to disk", http.MethodPost, "/sandboxes/"+id+"/pause", body, http.StatusNoContent, nil)
}

// ForkChild is one entry of a fork's answer: exactly one of Sandbox and Error is set.
type ForkChild struct {
	Sandbox *Sandbox `json:"sandbox"`
	Error   *struct {
		Code    int    `json:"code"`
		Message string `json:"message"`
	} `json:"error"`
}

// Fork forks a running sandbox into count children (POST /sandboxes/{id}/fork), each with
// a TTL of timeout seconds.
func (c *Client) Fork(ctx context.Context, id string, count, timeout int) ([]ForkChild, error) {
	var out []ForkChild
	body := map[string]int{"count": count, "timeout": timeout}
	err := c.do(ctx, "fork "+id, http.MethodPost, "/sandboxes/"+id+"/fork", body, http.StatusCreated, &out)
	if err == nil && len(out) != count {
		err = fmt.Errorf("fork %s: %d results for %d children", id, len(out), count)
	}
	return out, err
}

// Connect connects to a sandbox (POST /sandboxes/{id}/connect), resuming it when paused.
func (c *Client) Connect(ctx context.Context, id string, timeout int) (Sandbox, error) {
	var sb Sandbox
	body := map[string]int{"timeout": timeout}
	err := c.do(ctx, "connect "+id, http.MethodPost, "/sandboxes/"+id+"/connect", body, 0, &sb)
	return sb, err
}

// MemoryMB is a sandbox's guest memory (GET /sandboxes/{id}).
func (c *Client) MemoryMB(ctx context.Context, id string) (int, error) {
	var d struct {
		MemoryMB int `json:"memoryMB"`
	}
	err := c.do(ctx, "get "+id, http.MethodGet, "/sandboxes/"+id, nil, http.StatusOK, &d)
	return d.MemoryMB, err
}

// PauseKeepingMemory pauses a sandbox with {"memory": true}: on a backend with memory
// snapshots its processes continue after the connect that resumes it.
func (c *Client) PauseKeepingMemory(ctx context.Context, id string) error {
	body := map[string]bool{"memory": true}
	return c.do(ctx, "pause "+id+" with memory", http.MethodPost, "/sandboxes/"+id+"/pause", body, http.StatusNoContent, nil)
}

// Snapshot snapshots a running sandbox (POST /sandboxes/{id}/snapshots) and returns the
// snapshot's id, which creates sandboxes as a template id does.
func (c *Client) Snapshot(ctx context.Context, id string) (string, error) {
	var info struct {
		ID string `json:"snapshotID"`
	}
	err := c.do(ctx, "snapshot "+id, http.MethodPost, "/sandboxes/"+id+"/snapshots", map[string]string{}, http.StatusCreated, &info)
	if err == nil && info.ID == "" {
		err = fmt.Errorf("snapshot %s: answer has no snapshotID", id)
	}
	return info.ID, err
}

// DeleteTemplate deletes a template or snapshot (DELETE /templates/{id}).
func (c *Client) DeleteTemplate(ctx context.Context, id string) error {
	return c.do(ctx, "delete "+id, http.MethodDelete, "/templates/"+id, nil, 0, nil)
}

// SandboxState is one entry of GET /v2/sandboxes.
type SandboxState struct {
	ID    string `json:"sandboxID"`
	State string `json:"state"`
}

// List lists the node's sandboxes, running and paused, following X-Next-Token pages.
func (c *Client) List(ctx context.Context) ([]SandboxState, error) {
	var all []SandboxState
	next := ""
	for {
		path := "/v2/sandboxes?limit=100"
		if next != "" {
			path += "&nextToken=" + url.QueryEscape(next)
		}
		var page []SandboxState
		h, err := c.doHeader(ctx, "list sandboxes", http.MethodGet, path, nil, http.StatusOK, &page)
		if err != nil {
			return nil, err
		}
		all = append(all, page...)
		if next = h.Get("X-Next-Token"); next == "" || len(page) == 0 {
			return all, nil
		}
	}
}

// do sends one JSON request. want 0 accepts any 2xx.
func (c *Client) do(ctx context.Context, op, method, path string, in any, want int, out any) error {
	_, err := c.doHeader(ctx, op, method, path, in, want, out)
	return err
}

func (c *Client) doHeader(ctx context.Context, op, method, path string, in any, want int, out any) (http.Header, error) {
	var body io.Reader
	if in != nil {
		raw, err := json.Marshal(in)
		if err != nil {
			return nil, fmt.Errorf("%s: %w", op, err)
		}
		body = bytes.NewReader(raw)
	}
	req, err := http.NewRequestWithContext(ctx, method, c.base+path, body)
	if err != nil {
		return nil, fmt.Errorf("%s: %w", op, err)
	}
	req.Header.Set("X-API-Key", c.key)
	if in != nil {
		req.Header.Set("Content-Type", "application/json")
	}
	resp, err := c.http.Do(req)
	if err != nil {
		return nil, fmt.Errorf("%s: %w", op, err)
	}
	defer resp.Body.Close()
	raw, err := io.ReadAll(resp.Body)
	if err != nil {
		return nil, fmt.Errorf("%s: read answer: %w", op, err)
	}
	ok := resp.StatusCode == want || (want == 0 && resp.StatusCode/100 == 2)
	if !ok {
		var e struct {
			Message string `json:"message"`
		}
		msg := strings.TrimSpace(string(raw))
		if json.Unmarshal(raw, &e) == nil && e.Message != "" {
			msg = e.Message
		}
		return nil, &APIError{Op: op, Status: resp.StatusCode, Message: msg}
	}
	if out != nil {
		if err := json.Unmarshal(raw, out); err != nil {
			return nil, fmt.Errorf("%s: decode answer: %w", op, err)
		}
	}
	return resp.Header, nil
}

// CommandResult is how a command in a sandbox ended.
type CommandResult struct {
	ExitCode int
	Stdout   string
	Stderr   string
}

// Run runs cmdline with /bin/bash -l -c in the sandbox, as the SDKs' commands.run does,
// through envd's process.Process/Start stream via the node's proxy, and returns once the
// end event arrives.
func (c *Client) Run(ctx context.Context, sb Sandbox, cmdline string) (CommandResult, error) {
	return c.RunAs(ctx, sb, "", cmdline)
}

// RunAs is Run as user (the sandbox's default user when empty).
func (c *Client) RunAs(ctx context.Context, sb Sandbox, user, cmdline string) (CommandResult, error) {
	envd := envdclient.New(c.http, c.base, envdclient.WithSandbox(sb.ID, envdPort), envdclient.WithAccessToken(sb.Token))
	p, err := envd.Start(ctx, envdclient.Command{Cmd: "/bin/bash", Args: []string{"-l", "-c", cmdline}, User: user})
	if errors.Is(err, envdclient.ErrNoStart) {
		return CommandResult{}, fmt.Errorf("%q in %s: stream ended without an end event", cmdline, sb.ID)
	}
	var recvErr *envdclient.ReceiveError
	if errors.As(err, &recvErr) {
		return CommandResult{}, fmt.Errorf("%q in %s: %w", cmdline, sb.ID, recvErr.Err)
	}
	if err != nil {
		return CommandResult{}, fmt.Errorf("start %q in %s: %w", cmdline, sb.ID, err)
	}
	defer p.Close()
	var stdout, stderr strings.Builder
	end, err := p.Wait(&stdout, &stderr)
	if errors.Is(err, envdclient.ErrNoEnd) {
		return CommandResult{}, fmt.Errorf("%q in %s: stream ended without an end event", cmdline, sb.ID)
	}
	if err != nil {
		return CommandResult{}, fmt.Errorf("%q in %s: %w", cmdline, sb.ID, err)
	}
	res := CommandResult{ExitCode: int(end.GetExitCode()), Stdout: stdout.String(), Stderr: stderr.String()}
	if end.Error != nil && !end.GetExited() {
		return res, fmt.Errorf("%q in %s: %s", cmdline, sb.ID, end.GetError())
	}
	return res, nil
}
