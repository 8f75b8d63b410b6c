package orchestrator

import (
	"bytes"
	"context"
	"fmt"
	"io"
	"net/http"
	"net/url"

	"github.com/aenv-dev/aenv/internal/sandbox"
	"github.com/aenv-dev/aenv/internal/sandboxconn"
)

// The node's egress proxy terminates the TLS of connections to domains that have
// network.rules (so it can set their headers) with certificates of the node's egress CA.
// Sandboxes with rules are given that CA, as E2B's templates carry their platform CA: as
// a file in Debian's local CA directory, appended to the system bundle that OpenSSL,
// curl, Python and git read, and named by NODE_EXTRA_CA_CERTS (Node.js keeps its own
// roots otherwise).
const (
	egressCAPath   = "/usr/local/share/ca-certificates/aenv-egress-ca.crt"
	systemCABundle = "/etc/ssl/certs/ca-certificates.crt"
)

// wantsEgressCA reports whether rec's sandbox must trust the node's egress CA.
func (o *Orchestrator) wantsEgressCA(rec *Sandbox) bool {
	return len(o.cfg.EgressCA) > 0 && len(rec.Egress.Rules) > 0
}

// egressCAEnv adds NODE_EXTRA_CA_CERTS for a sandbox that gets the CA, unless the
// sandbox sets it itself.
func (o *Orchestrator) egressCAEnv(rec *Sandbox, env map[string]string) {
	if _, set := env["NODE_EXTRA_CA_CERTS"]; o.wantsEgressCA(rec) && !set {
		env["NODE_EXTRA_CA_CERTS"] = egressCAPath
	}
}

// installEgressCA writes the node's egress CA into the sandbox through envd, as root:
// the CA file, and the system bundle with the CA appended when the image has one and it
// lacks the CA. It is idempotent (a resumed sandbox, a snapshot of one, an update of its
// rules).
func (o *Orchestrator) installEgressCA(ctx context.Context, ep sandbox.Endpoint, rec *Sandbox) error {
	ctx = sandboxconn.WithSandbox(ctx, rec.ID)
	ca := o.cfg.EgressCA
	if err := o.envdWriteFile(ctx, ep, rec, egressCAPath, ca); err != nil {
		return err
	}
	bundle, found, err := o.envdReadFile(ctx, ep, rec, systemCABundle)
	if err != nil || !found || bytes.Contains(bundle, bytes.TrimSpace(ca)) {
		return err
	}
	if len(bundle) > 0 && bundle[len(bundle)-1] != '\n' {
		bundle = append(bundle, '\n')
	}
	return o.envdWriteFile(ctx, ep, rec, systemCABundle, append(bundle, ca...))
}

func (o *Orchestrator) envdFileURL(ep sandbox.Endpoint, path string) string {
	return o.envdURL(ep) + "/files?" + url.Values{"path": {path}, "username": {"root"}}.Encode()
}

func (o *Orchestrator) envdWriteFile(ctx context.Context, ep sandbox.Endpoint, rec *Sandbox, path string, data []byte) error {
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, o.envdFileURL(ep, path), bytes.NewReader(data))
	if err != nil {
		return fmt.Errorf("write %s: %w", path, err)
	}
	req.Header.Set("Content-Type", "application/octet-stream")
	resp, err := o.envdFileDo(req, rec)
	if err != nil {
		return fmt.Errorf("write %s: %w", path, err)
	}
	defer resp.Body.Close()
	msg, _ := io.ReadAll(io.LimitReader(resp.Body, 4096))
	if resp.StatusCode != http.StatusOK {
		return fmt.Errorf("write %s: envd answered %d: %s", path, resp.StatusCode, bytes.TrimSpace(msg))
	}
	return nil
}

// envdReadFile reads a file of at most 16 MiB; found is false when it does not exist.
func (o *Orchestrator) envdReadFile(ctx context.Context, ep sandbox.Endpoint, rec *Sandbox, path string) ([]byte, bool, error) {
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, o.envdFileURL(ep, path), nil)
	if err != nil {
		return nil, false, fmt.Errorf("read %s: %w", path, err)
	}
	resp, err := o.envdFileDo(req, rec)
	if err != nil {
		return nil, false, fmt.Errorf("read %s: %w", path, err)
	}
	defer resp.Body.Close()
	const limit = 16 << 20
	b, err := io.ReadAll(io.LimitReader(resp.Body, limit+1))
	switch {
	case resp.StatusCode == http.StatusNotFound:
		return nil, false, nil
	case resp.StatusCode != http.StatusOK:
		return nil, false, fmt.Errorf("read %s: envd answered %d: %s", path, resp.StatusCode, bytes.TrimSpace(b[:min(len(b), 4096)]))
	case err != nil:
		return nil, false, fmt.Errorf("read %s: %w", path, err)
	case len(b) > limit:
		return nil, false, fmt.Errorf("read %s: larger than %d bytes", path, limit)
	}
	return b, true, nil
}

func (o *Orchestrator) envdFileDo(req *http.Request, rec *Sandbox) (*http.Response, error) {
	if rec.EnvdAccessToken != "" {
		req.Header.Set("X-Access-Token", rec.EnvdAccessToken)
	}
	return o.envd.Do(req)
}
