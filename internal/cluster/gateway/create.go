package gateway

import (
	"bytes"
	"context"
	"encoding/json"
	"io"
	"net/http"
	"strings"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	pb "github.com/aenv-dev/aenv/internal/cluster/scheduler/gen/schedulerv1"
)

// createAttempts is how many nodes a create tries when a node cannot be reached, is
// full or does not know the template (yet); a node that answered anything else has
// decided the create.
const createAttempts = 3

// notFound is a node's 404 to a create: the template or snapshot is not in its catalog.
// A snapshot taken on one node reaches the others' catalogs only at their next sync of
// the repository, so another node is tried; the 404 is the answer when none knows it.
type notFound struct {
	header http.Header
	body   []byte
}

func (n *notFound) write(w http.ResponseWriter) {
	copyHeader(w.Header(), n.header)
	w.WriteHeader(http.StatusNotFound)
	_, _ = w.Write(n.body)
}

// Resources a create asks the scheduler for when the request names none (the nodes'
// defaults, sandbox.default_cpu and default_memory_mb).
const (
	defaultCPU      = 2
	defaultMemoryMB = 512
)

// create places a new sandbox, forwards the create to the chosen node and binds the new
// sandbox to it.
func (g *Gateway) create(w http.ResponseWriter, r *http.Request) {
	body, err := io.ReadAll(io.LimitReader(r.Body, maxCreateBody+1))
	if err != nil {
		writeError(w, http.StatusBadRequest, "read the request: %v", err)
		return
	}
	if len(body) > maxCreateBody {
		writeError(w, http.StatusRequestEntityTooLarge, "the create request is larger than %d bytes", maxCreateBody)
		return
	}
	var req struct {
		TemplateID string `json:"templateID"`
		CPUCount   int32  `json:"cpuCount"`
		MemoryMB   int64  `json:"memoryMB"`
		// Volumes and secrets live on one node; the gateway refuses creates that use them.
		VolumeMounts []json.RawMessage `json:"volumeMounts"`
		EnvVars      map[string]string `json:"envVars"`
	}
	if len(bytes.TrimSpace(body)) > 0 {
		if err := json.Unmarshal(body, &req); err != nil {
			writeError(w, http.StatusBadRequest, "the request body is not a JSON sandbox request: %v", err)
			return
		}
	}
	if usesNodeLocal(req.VolumeMounts, req.EnvVars) {
		writeError(w, http.StatusNotImplemented, "volumeMounts and ${e2b.secrets.*} envVars refer to volumes and secrets, which are "+
			"node-local: create such a sandbox through a node's own API, not the gateway")
		return
	}
	if req.CPUCount <= 0 {
		req.CPUCount = defaultCPU
	}
	if req.MemoryMB <= 0 {
		req.MemoryMB = defaultMemoryMB
	}
	place := &pb.PlaceRequest{
		Resources:  &pb.Resources{CpuCount: req.CPUCount, MemoryMb: req.MemoryMB},
		TemplateId: req.TemplateID,
	}
	var missing *notFound
	for range createAttempts {
		ctx, cancel := context.WithTimeout(r.Context(), schedulerTimeout)
		p, err := g.sched.Place(ctx, place)
		cancel()
		if err != nil {
			switch {
			case missing != nil && status.Code(err) == codes.ResourceExhausted:
				missing.write(w) // no other node to ask
			case status.Code(err) == codes.ResourceExhausted:
				writeError(w, http.StatusServiceUnavailable, "no node can take the sandbox: %s", status.Convert(err).Message())
			default:
				g.schedulerError(w, "place the sandbox", err)
			}
			return
		}
		t, err := targetOf(p.Node)
		if err == nil {
			done, nf := g.createOn(w, r, body, t, p.ReservationId)
			if done {
				return
			}
			if nf != nil {
				missing = nf
			}
		}
		g.release(p.ReservationId)
		place.ExcludeNodeIds = append(place.ExcludeNodeIds, p.Node.Id)
	}
	if missing != nil {
		missing.write(w)
		return
	}
	writeError(w, http.StatusServiceUnavailable, "no node took the sandbox after %d attempts (tried %s)",
		createAttempts, strings.Join(place.ExcludeNodeIds, ", "))
}

// createOn sends the create to t. It returns false, having written nothing, when the
// node could not be reached, was full or did not know the template (then with its 404),
// so another node can be tried.
func (g *Gateway) createOn(w http.ResponseWriter, r *http.Request, body []byte, t *target, reservation string) (bool, *notFound) {
	resp, done := g.sendTo(w, r, body, t, "create", nil)
	if resp == nil {
		if done {
			g.release(reservation)
		}
		return done, nil
	}
	if resp.StatusCode == http.StatusNotFound {
		raw, err := io.ReadAll(io.LimitReader(resp.Body, maxCreateBody))
		resp.Body.Close()
		if err == nil {
			g.log.Info("create: the node does not know the template (yet); trying another", "node", t.node)
			return false, &notFound{header: resp.Header.Clone(), body: raw}
		}
		writeError(w, http.StatusBadGateway, "node %s: read the create answer: %v", t.node, err)
		return true, nil
	}
	if resp.StatusCode != http.StatusCreated {
		g.release(reservation)
		copyResponse(w, resp)
		return true, nil
	}
	raw, err := io.ReadAll(io.LimitReader(resp.Body, maxCreateBody))
	resp.Body.Close()
	if err != nil {
		writeError(w, http.StatusBadGateway, "node %s: read the create answer: %v", t.node, err)
		return true, nil
	}
	var sb struct {
		SandboxID string `json:"sandboxID"`
	}
	if json.Unmarshal(raw, &sb) == nil && sb.SandboxID != "" {
		g.bind(r.Context(), sb.SandboxID, t.node, reservation)
	}
	copyHeader(w.Header(), resp.Header)
	w.WriteHeader(resp.StatusCode)
	_, _ = w.Write(raw)
	return true, nil
}

// sendTo sends r's method, path, query and headers (edited by header when not nil)
// with body to t. A nil answer with done false means t could not be reached or
// was full, so another node may be tried; with done true the request is over (the
// caller's client went away, or an error answer was written).
func (g *Gateway) sendTo(w http.ResponseWriter, r *http.Request, body []byte, t *target, op string, header func(http.Header)) (resp *http.Response, done bool) {
	u := *t.base
	u.Path, u.RawQuery = r.URL.Path, r.URL.RawQuery
	out, err := http.NewRequestWithContext(r.Context(), r.Method, u.String(), bytes.NewReader(body))
	if err != nil {
		writeError(w, http.StatusInternalServerError, "%v", err)
		return nil, true
	}
	out.Header = r.Header.Clone()
	if header != nil {
		header(out.Header)
	}
	resp, err = g.client.Do(out)
	if err != nil {
		if r.Context().Err() != nil {
			return nil, true
		}
		g.log.Warn(op+": node unreachable; trying another", "node", t.node, "err", err)
		return nil, false
	}
	if resp.StatusCode == http.StatusServiceUnavailable || resp.StatusCode == http.StatusTooManyRequests {
		resp.Body.Close()
		g.log.Info(op+": node full; trying another", "node", t.node, "status", resp.StatusCode)
		return nil, false
	}
	return resp, true
}

// bind records a new sandbox's node. A failure is logged, not returned: the node's next
// heartbeat binds it anyway.
func (g *Gateway) bind(ctx context.Context, sandboxID, node, reservation string) {
	ctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), schedulerTimeout)
	defer cancel()
	if _, err := g.sched.Bind(ctx, &pb.BindRequest{SandboxId: sandboxID, NodeId: node, ReservationId: reservation}); err != nil {
		g.log.Warn("bind sandbox; the node's next heartbeat will", "sandbox", sandboxID, "node", node, "err", err)
	}
}

func (g *Gateway) release(reservation string) {
	ctx, cancel := context.WithTimeout(context.Background(), schedulerTimeout)
	defer cancel()
	if _, err := g.sched.Release(ctx, &pb.ReleaseRequest{ReservationId: reservation}); err != nil {
		g.log.Debug("release reservation; it expires by itself", "err", err)
	}
}

// bindForked binds the sandboxes a fork answer names to the node that made them, so
// they are reachable through the gateway before that node's next heartbeat.
func (g *Gateway) bindForked(resp *http.Response) error {
	r := resp.Request
	if r.Method != http.MethodPost || !strings.HasSuffix(r.URL.Path, "/fork") || resp.StatusCode/100 != 2 {
		return nil
	}
	t, _ := r.Context().Value(targetKey{}).(*target)
	if t == nil {
		return nil
	}
	raw, err := io.ReadAll(io.LimitReader(resp.Body, maxCreateBody))
	resp.Body.Close()
	if err != nil {
		return err
	}
	resp.Body = io.NopCloser(bytes.NewReader(raw))
	var v any
	if json.Unmarshal(raw, &v) == nil {
		for _, id := range sandboxIDs(v, nil) {
			g.bind(r.Context(), id, t.node, "")
		}
	}
	return nil
}

// sandboxIDs collects every "sandboxID" string in a JSON document.
func sandboxIDs(v any, out []string) []string {
	switch x := v.(type) {
	case map[string]any:
		for k, e := range x {
			if s, ok := e.(string); ok && k == "sandboxID" && s != "" {
				out = append(out, s)
				continue
			}
			out = sandboxIDs(e, out)
		}
	case []any:
		for _, e := range x {
			out = sandboxIDs(e, out)
		}
	}
	return out
}

// copyResponse writes a node's answer as it is.
func copyResponse(w http.ResponseWriter, resp *http.Response) {
	defer resp.Body.Close()
	copyHeader(w.Header(), resp.Header)
	w.WriteHeader(resp.StatusCode)
	_, _ = io.Copy(w, resp.Body)
}

func copyHeader(dst, src http.Header) {
	for k, vs := range src {
		if k == "Connection" || k == "Transfer-Encoding" || k == "Content-Length" {
			continue
		}
		dst[k] = append([]string(nil), vs...)
	}
}

func usesNodeLocal(mounts []json.RawMessage, env map[string]string) bool {
	if len(mounts) > 0 {
		return true
	}
	for _, v := range env {
		if strings.Contains(v, "${e2b.secrets.") {
			return true
		}
	}
	return false
}
