package orchestrator

import (
	"bytes"
	"cmp"
	"context"
	"crypto/rand"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"regexp"
	"strconv"
	"time"

	"github.com/aenv-dev/aenv/internal/sandbox"
)

// E2B template defaults (protocol §4): commands run as "user" in /home/user.
const (
	defaultUser    = "user"
	defaultWorkdir = "/home/user"
)

var semver = regexp.MustCompile(`^[0-9]+\.[0-9]+\.[0-9]+$`)

// envdInit is the POST /init body (e2b-protocol.md §3.6; key names are envd's).
type envdInit struct {
	EnvVars        map[string]string `json:"envVars"`
	AccessToken    *string           `json:"accessToken,omitempty"`
	DefaultUser    string            `json:"defaultUser"`
	DefaultWorkdir string            `json:"defaultWorkdir"`
	Timestamp      string            `json:"timestamp"`
	// Entropy reseeds the kernel's random generator of a sandbox whose memory came
	// from a capture (aenv's envd; others ignore it): without it a fork's children and
	// its parent go on with one generator state and read the same random bytes.
	Entropy []byte `json:"entropy,omitempty"`
}

// entropyBytes is how much Entropy carries: a key's worth for the kernel's generator.
const entropyBytes = 32

// envdURL is the base URL of an instance's envd.
func (o *Orchestrator) envdURL(ep sandbox.Endpoint) string {
	port := ep.EnvdPort
	if port == 0 {
		port = o.cfg.EnvdPort
	}
	return "http://" + net.JoinHostPort(ep.Host, strconv.Itoa(port))
}

// waitEnvd polls GET /health until envd answers 204. The backoff starts at 1 ms
// and stops growing at 10 ms because a container's envd is up within tens of
// milliseconds and every millisecond of polling slack lands on create latency; a
// refused connection costs microseconds, so polling often is cheap.
func (o *Orchestrator) waitEnvd(ctx context.Context, ep sandbox.Endpoint) error {
	ctx, cancel := context.WithTimeout(ctx, o.cfg.EnvdReadyTimeout)
	defer cancel()
	url := o.envdURL(ep) + "/health"
	delay := time.Millisecond
	var last error
	for {
		req, err := http.NewRequestWithContext(ctx, http.MethodGet, url, nil)
		if err != nil {
			return fmt.Errorf("envd health: %w", err)
		}
		resp, err := o.envd.Do(req)
		if err == nil {
			io.Copy(io.Discard, io.LimitReader(resp.Body, 4096))
			resp.Body.Close()
			if resp.StatusCode == http.StatusNoContent || resp.StatusCode == http.StatusOK {
				return nil
			}
			err = fmt.Errorf("status %d", resp.StatusCode)
		}
		last = err
		t := time.NewTimer(delay)
		select {
		case <-ctx.Done():
			t.Stop()
			return fmt.Errorf("envd at %s not healthy within %s: %w (last: %v)", url, o.cfg.EnvdReadyTimeout, ctx.Err(), last)
		case <-t.C:
		}
		delay = min(delay*2, 10*time.Millisecond)
	}
}

// initEnvd hands envd its environment, token and default user. held is the token the
// instance's envd may already hold (its memory came from a capture: a resumed pause, or
// a fork or snapshot launch, whose envd holds the source's token), which envd requires in
// X-Access-Token; it is replaced by rec's (cleared when rec has none). restored: the
// instance continues captured memory, and envd gets fresh entropy. It returns the envd
// version envd reports.
func (o *Orchestrator) initEnvd(ctx context.Context, ep sandbox.Endpoint, rec *Sandbox, held string, restored bool) (string, error) {
	env, err := o.sandboxEnv(rec)
	if err != nil {
		return "", err
	}
	o.egressCAEnv(rec, env)
	env["E2B_SANDBOX"] = "true"
	env["E2B_SANDBOX_ID"] = rec.ID
	env["E2B_TEMPLATE_ID"] = rec.TemplateID
	body := envdInit{
		EnvVars:        env,
		DefaultUser:    cmp.Or(rec.Launch.DefaultUser, defaultUser),
		DefaultWorkdir: cmp.Or(rec.Launch.DefaultWorkdir, defaultWorkdir),
		Timestamp:      o.clock.Now().UTC().Format(time.RFC3339Nano),
	}
	if rec.EnvdAccessToken != "" || held != "" {
		body.AccessToken = &rec.EnvdAccessToken
	}
	if restored {
		body.Entropy = make([]byte, entropyBytes)
		rand.Read(body.Entropy) // never fails (crypto/rand)
	}
	raw, err := json.Marshal(body)
	if err != nil {
		return "", fmt.Errorf("envd init: %w", err)
	}
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, o.envdURL(ep)+"/init", bytes.NewReader(raw))
	if err != nil {
		return "", fmt.Errorf("envd init: %w", err)
	}
	req.Header.Set("Content-Type", "application/json")
	if held != "" {
		req.Header.Set("X-Access-Token", held)
	}
	resp, err := o.envd.Do(req)
	if err != nil {
		return "", fmt.Errorf("envd init: %w", err)
	}
	defer resp.Body.Close()
	msg, _ := io.ReadAll(io.LimitReader(resp.Body, 4096))
	if resp.StatusCode/100 != 2 {
		return "", fmt.Errorf("envd init: status %d: %s", resp.StatusCode, bytes.TrimSpace(msg))
	}
	// The JS SDK throws on a version that is not dotted semver, so a malformed header
	// falls back to the configured version instead of breaking every client.
	if v := resp.Header.Get("X-Envd-Version"); semver.MatchString(v) {
		return v, nil
	}
	return o.cfg.EnvdVersion, nil
}
