package gateway

import (
	"bytes"
	"context"
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"strings"
	"sync"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	pb "github.com/aenv-dev/aenv/internal/cluster/scheduler/gen/schedulerv1"
)

// Fork defaults and bounds, as on a node (server.defaultForkTimeout, orchestrator.MaxForkCount).
const (
	defaultForkTimeout = 15
	maxForkCount       = 100
	// forkSnapshotPrefix starts the name of the snapshot a fanned-out fork creates its
	// children from ("fork-of-<source id>-<random>"), so one left behind when its delete
	// fails (the source's node went away) says what it is in GET /snapshots.
	forkSnapshotPrefix = "fork-of-"
	// deleteWait bounds the delete of that snapshot once the children exist.
	deleteWait = time.Minute
	// publishWait bounds how long a child on another node waits for the fork's snapshot
	// to be published; publishPoll is how often it asks.
	publishWait = 2 * time.Minute
	publishPoll = 200 * time.Millisecond
)

// isFork reports whether r forks sandbox id.
func isFork(r *http.Request) (string, bool) {
	if r.Method != http.MethodPost {
		return "", false
	}
	rest, ok := strings.CutPrefix(r.URL.Path, "/sandboxes/")
	if !ok {
		return "", false
	}
	id, ok := strings.CutSuffix(rest, "/fork")
	return id, ok && id != "" && !strings.Contains(id, "/")
}

// forkChild is one entry of a fork's answer (SandboxForkResult): exactly one field is set.
type forkChild struct {
	Sandbox json.RawMessage `json:"sandbox,omitempty"`
	Error   *forkError      `json:"error,omitempty"`
}

type forkError struct {
	Code    int    `json:"code"`
	Message string `json:"message"`
}

// fork serves POST /sandboxes/{id}/fork. The children are placed one by one with the
// source's node preferred: while it has room they all go there and the fork is forwarded
// to it unchanged (one local capture, as AgentENV keeps forks). When it cannot hold them
// all, the source is snapshotted once on its node, which publishes the snapshot to the
// shared repository, and every child is created from that snapshot on the node the
// scheduler placed it on: as many as fit on the source's node, the rest elsewhere, which
// fetch the snapshot from the repository. Children that no node can take fail on their own.
// The snapshot is deleted once every child exists: E2B's fork makes no snapshot, and the
// children do not need it (see deleteForkSnapshot).
func (g *Gateway) fork(w http.ResponseWriter, r *http.Request, id string) {
	body, err := io.ReadAll(io.LimitReader(r.Body, maxCreateBody+1))
	if err != nil || len(body) > maxCreateBody {
		writeError(w, http.StatusBadRequest, "read the request: body unreadable or larger than %d bytes", maxCreateBody)
		return
	}
	passOn := func() {
		r.Body = io.NopCloser(bytes.NewReader(body))
		r.ContentLength = int64(len(body))
		g.toSandbox(w, r, id)
	}
	var req struct {
		Count   *int `json:"count"`
		Timeout *int `json:"timeout"`
	}
	if len(bytes.TrimSpace(body)) > 0 && json.Unmarshal(body, &req) != nil {
		passOn() // the node explains what is wrong with it
		return
	}
	count, timeout := 1, defaultForkTimeout
	if req.Count != nil {
		count = *req.Count
	}
	if req.Timeout != nil {
		timeout = *req.Timeout
	}
	if count < 1 || count > maxForkCount || timeout < 0 {
		passOn()
		return
	}
	l, err := g.lookup(r.Context(), id)
	if err != nil || l.State == pb.NodeState_NODE_STATE_STALE {
		passOn() // unknown or lost: toSandbox says so
		return
	}
	src := l.Node.GetId()
	place := &pb.PlaceRequest{Resources: &pb.Resources{CpuCount: defaultCPU, MemoryMb: defaultMemoryMB},
		Backend: l.Node.GetBackend(), PreferNodeId: src}
	if sb := l.GetSandbox(); sb != nil {
		place.TemplateId = sb.TemplateId
		if res := sb.GetResources(); res.GetCpuCount() > 0 {
			place.Resources = &pb.Resources{CpuCount: res.CpuCount, MemoryMb: res.MemoryMb}
		}
	}
	placed, err := g.placeChildren(r.Context(), place, count)
	if err != nil {
		g.schedulerError(w, "place the fork's children", err)
		return
	}
	local := 0
	for _, p := range placed {
		if p.Node.GetId() == src {
			local++
		}
	}
	if local == count {
		// All on the source's node: its heartbeats account for the children.
		g.releaseAll(placed)
		passOn()
		return
	}
	g.fanOut(w, r, id, l.Node, placed, count, timeout)
}

// placeChildren places up to count children; fewer when the cluster runs out of room.
func (g *Gateway) placeChildren(ctx context.Context, place *pb.PlaceRequest, count int) ([]*pb.PlaceResponse, error) {
	var placed []*pb.PlaceResponse
	for range count {
		pctx, cancel := context.WithTimeout(ctx, schedulerTimeout)
		p, err := g.sched.Place(pctx, place)
		cancel()
		if status.Code(err) == codes.ResourceExhausted && len(placed) > 0 {
			break
		}
		if err != nil {
			g.releaseAll(placed)
			return nil, err
		}
		placed = append(placed, p)
	}
	return placed, nil
}

func (g *Gateway) releaseAll(placed []*pb.PlaceResponse) {
	for _, p := range placed {
		g.release(p.ReservationId)
	}
}

// fanOut snapshots the source on its node and creates the children from the snapshot
// where they were placed; count-len(placed) children found no room and fail.
func (g *Gateway) fanOut(w http.ResponseWriter, r *http.Request, id string, srcNode *pb.NodeInfo, placed []*pb.PlaceResponse, count, timeout int) {
	src, err := targetOf(srcNode)
	if err != nil {
		g.releaseAll(placed)
		writeError(w, http.StatusBadGateway, "%v", err)
		return
	}
	// The source's settings the children keep: a create from a snapshot takes its
	// template's resources and environment, the rest comes from the request.
	var detail struct {
		Metadata      map[string]string `json:"metadata"`
		Token         string            `json:"envdAccessToken"`
		AllowInternet *bool             `json:"allowInternetAccess"`
		Network       json.RawMessage   `json:"network"`
	}
	if code, raw := g.call(r, src, http.MethodGet, "/sandboxes/"+id, nil); code != http.StatusOK {
		g.releaseAll(placed)
		writeRaw(w, code, raw)
		return
	} else if err := json.Unmarshal(raw, &detail); err != nil {
		g.releaseAll(placed)
		writeError(w, http.StatusBadGateway, "node %s: read sandbox %s: %v", src.node, id, err)
		return
	}
	var suffix [4]byte
	_, _ = rand.Read(suffix[:]) // never fails (crypto/rand)
	name := forkSnapshotPrefix + id + "-" + hex.EncodeToString(suffix[:])
	snapReq, _ := json.Marshal(map[string]string{"name": name})
	code, raw := g.call(r, src, http.MethodPost, "/sandboxes/"+id+"/snapshots", snapReq)
	var snap struct {
		ID string `json:"snapshotID"`
	}
	if code != http.StatusCreated || json.Unmarshal(raw, &snap) != nil || snap.ID == "" {
		g.releaseAll(placed)
		writeRaw(w, code, raw)
		return
	}
	// After the children's creates (they wait for it), before the answer: once the fork
	// answers, its snapshot is gone from the source's node and the repository.
	deleteSnap := sync.OnceFunc(func() { g.deleteForkSnapshot(r, src, snap.ID, name) })
	defer deleteSnap()
	req := map[string]any{"templateID": snap.ID, "timeout": timeout, "secure": detail.Token != ""}
	if detail.Metadata != nil {
		req["metadata"] = detail.Metadata
	}
	if detail.AllowInternet != nil {
		req["allowInternetAccess"] = *detail.AllowInternet
	}
	if len(detail.Network) > 0 && string(detail.Network) != "null" {
		req["network"] = detail.Network
	}
	create, err := json.Marshal(req)
	if err != nil {
		g.releaseAll(placed)
		writeError(w, http.StatusInternalServerError, "%v", err)
		return
	}
	out := make([]forkChild, count)
	var wg sync.WaitGroup
	for i, p := range placed {
		wg.Add(1)
		go func() {
			defer wg.Done()
			out[i] = g.createChild(r, p, create)
		}()
	}
	wg.Wait()
	for i := len(placed); i < count; i++ {
		out[i].Error = &forkError{Code: http.StatusServiceUnavailable, Message: "no node has room for this fork child"}
	}
	deleteSnap()
	g.log.Info("fork fanned out", "sandbox", id, "node", src.node, "snapshot", snap.ID, "children", count)
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(http.StatusCreated)
	_ = json.NewEncoder(w).Encode(out)
}

// deleteForkSnapshot deletes a fanned-out fork's snapshot on the source's node, from its
// catalog and from the shared repository, once every child exists (or failed), even when
// the client has gone. The children do not need it: on the source's node a sandbox keeps
// the layers it runs on when its template or snapshot is deleted (the node's DeleteTemplate
// contract, TestDeleteSnapshotUsedBySandboxes); a node that created children from it pins
// their layers, keeps their blobs alive in the repository (its keep-alive refreshes them
// well inside GC's grace) and keeps the synced entry, listed, until they are gone (its
// sync defers removing entries in use), then drops it. A failed delete leaves the
// snapshot named fork-of-<source>-<random> for the caller to delete.
func (g *Gateway) deleteForkSnapshot(r *http.Request, src *target, snapID, name string) {
	ctx, cancel := context.WithTimeout(context.WithoutCancel(r.Context()), deleteWait)
	defer cancel()
	code, raw := g.call(r.WithContext(ctx), src, http.MethodDelete, "/templates/"+snapID, nil)
	if code != http.StatusNoContent && code != http.StatusNotFound {
		g.log.Warn("delete a fork's snapshot: it stays", "snapshot", snapID, "name", name, "node", src.node,
			"status", code, "answer", string(raw))
	}
}

// createChild creates one child from the fork's snapshot on the node p placed it on and
// binds it there.
func (g *Gateway) createChild(r *http.Request, p *pb.PlaceResponse, body []byte) forkChild {
	t, err := targetOf(p.Node)
	if err != nil {
		g.release(p.ReservationId)
		return forkChild{Error: &forkError{Code: http.StatusBadGateway, Message: err.Error()}}
	}
	// The snapshot reaches the repository in the background after the snapshot call
	// answers; until then another node does not know it (404) and the create is retried.
	code, raw := g.call(r, t, http.MethodPost, "/sandboxes", body)
	for deadline := time.Now().Add(publishWait); code == http.StatusNotFound && time.Now().Before(deadline); {
		select {
		case <-r.Context().Done():
		case <-time.After(publishPoll):
		}
		code, raw = g.call(r, t, http.MethodPost, "/sandboxes", body)
	}
	var sb struct {
		SandboxID string `json:"sandboxID"`
	}
	if code != http.StatusCreated || json.Unmarshal(raw, &sb) != nil || sb.SandboxID == "" {
		g.release(p.ReservationId)
		var e forkError
		if json.Unmarshal(raw, &e) != nil || e.Message == "" {
			e.Message = fmt.Sprintf("node %s: create from the fork's snapshot: HTTP %d", t.node, code)
		}
		e.Code = code
		return forkChild{Error: &e}
	}
	g.bind(r.Context(), sb.SandboxID, t.node, p.ReservationId)
	return forkChild{Sandbox: raw}
}

// call sends a request with the caller's API key to t and returns the status and body
// (502 with an E2B error body when the node cannot be reached).
func (g *Gateway) call(r *http.Request, t *target, method, path string, body []byte) (int, []byte) {
	u := *t.base
	u.Path, u.RawQuery = path, ""
	var rd io.Reader
	if body != nil {
		rd = bytes.NewReader(body)
	}
	req, err := http.NewRequestWithContext(r.Context(), method, u.String(), rd)
	if err != nil {
		return http.StatusInternalServerError, errorBody(http.StatusInternalServerError, err.Error())
	}
	req.Header.Set("X-API-Key", r.Header.Get("X-API-Key"))
	if body != nil {
		req.Header.Set("Content-Type", "application/json")
	}
	resp, err := g.client.Do(req)
	if err != nil {
		return http.StatusBadGateway, errorBody(http.StatusBadGateway, fmt.Sprintf("node %s did not answer: %v", t.node, err))
	}
	defer resp.Body.Close()
	raw, err := io.ReadAll(io.LimitReader(resp.Body, maxCreateBody))
	if err != nil {
		return http.StatusBadGateway, errorBody(http.StatusBadGateway, fmt.Sprintf("node %s: read the answer: %v", t.node, err))
	}
	return resp.StatusCode, raw
}

func errorBody(code int, msg string) []byte {
	raw, _ := json.Marshal(forkError{Code: code, Message: msg})
	return raw
}

func writeRaw(w http.ResponseWriter, code int, raw []byte) {
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(code)
	_, _ = w.Write(raw)
}
