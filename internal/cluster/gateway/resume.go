package gateway

import (
	"context"
	"io"
	"net/http"
	"strings"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	pb "github.com/aenv-dev/aenv/internal/cluster/scheduler/gen/schedulerv1"
)

// headerAdopt lets the node a resume is sent to resume a sandbox that another node
// paused to disk and published (server.HeaderAdopt).
const headerAdopt = "X-Aenv-Adopt"

// isResume reports whether r resumes sandbox id: connect (v1, v2) or resume.
func isResume(r *http.Request, id string) bool {
	if r.Method != http.MethodPost {
		return false
	}
	p := r.URL.Path
	for _, pre := range []string{"/sandboxes/", "/v2/sandboxes/"} {
		for _, verb := range []string{"/connect", "/resume"} {
			if p == pre+id+verb && (verb == "/connect" || pre == "/sandboxes/") {
				return true
			}
		}
	}
	return false
}

// resume serves a connect or resume. A sandbox on a ready node is resumed there; when
// that node is gone (stale), draining or full, or the sandbox is bound to no node, the
// resume is placed on another node of the same backend, which claims the sandbox's
// published pause (only one node ever can) and resumes it under the same id.
func (g *Gateway) resume(w http.ResponseWriter, r *http.Request, id string) {
	body, err := io.ReadAll(io.LimitReader(r.Body, maxCreateBody+1))
	if err != nil || len(body) > maxCreateBody {
		writeError(w, http.StatusBadRequest, "read the request: body unreadable or larger than %d bytes", maxCreateBody)
		return
	}
	l, err := g.lookup(r.Context(), id)
	place := &pb.PlaceRequest{Resources: &pb.Resources{CpuCount: defaultCPU, MemoryMb: defaultMemoryMB}}
	switch status.Code(err) {
	case codes.OK:
		if sb := l.GetSandbox(); sb != nil {
			place.TemplateId = sb.TemplateId
			if res := sb.GetResources(); res.GetCpuCount() > 0 {
				place.Resources = &pb.Resources{CpuCount: res.CpuCount, MemoryMb: res.MemoryMb}
			}
		}
		place.Backend = l.Node.GetBackend()
		place.ExcludeNodeIds = []string{l.Node.GetId()}
		if l.State == pb.NodeState_NODE_STATE_READY {
			t, err := targetOf(l.Node)
			if err != nil {
				writeError(w, http.StatusBadGateway, "%v", err)
				return
			}
			t.sandbox = id
			if g.sendResume(w, r, body, t, "", false) {
				return
			}
			g.log.Info("resume: the sandbox's node is full or unreachable; resuming it on another node", "sandbox", id, "node", t.node)
		}
	case codes.NotFound:
		// Its node was forgotten: a published pause can still be resumed anywhere.
	default:
		g.schedulerError(w, "look up sandbox "+id, err)
		return
	}
	g.routes.drop(id)
	for range createAttempts {
		ctx, cancel := context.WithTimeout(r.Context(), schedulerTimeout)
		p, err := g.sched.Place(ctx, place)
		cancel()
		if err != nil {
			if status.Code(err) == codes.ResourceExhausted {
				writeError(w, http.StatusServiceUnavailable, "sandbox %s: no other node can resume it: %s", id, status.Convert(err).Message())
				return
			}
			g.schedulerError(w, "place the resume of "+id, err)
			return
		}
		t, err := targetOf(p.Node)
		if err == nil {
			t.sandbox = id
			if g.sendResume(w, r, body, t, p.ReservationId, true) {
				return
			}
		}
		g.release(p.ReservationId)
		place.ExcludeNodeIds = append(place.ExcludeNodeIds, p.Node.Id)
	}
	writeError(w, http.StatusServiceUnavailable, "sandbox %s: no node could resume it after %d attempts (tried %s)",
		id, createAttempts, strings.Join(place.ExcludeNodeIds, ", "))
}

// sendResume sends the resume to t (with the adopt header when adopt). It returns false,
// having written nothing, when t could not be reached or was full. A resume that
// succeeded elsewhere binds the sandbox to t with reservation.
func (g *Gateway) sendResume(w http.ResponseWriter, r *http.Request, body []byte, t *target, reservation string, adopt bool) bool {
	resp, done := g.sendTo(w, r, body, t, "resume", func(h http.Header) {
		h.Del(headerAdopt)
		if adopt {
			h.Set(headerAdopt, "1")
		}
	})
	if resp == nil {
		return done
	}
	if adopt && resp.StatusCode/100 == 2 {
		g.bind(r.Context(), t.sandbox, t.node, reservation)
	} else if reservation != "" {
		g.release(reservation)
	}
	if resp.StatusCode/100 == 2 {
		g.routes.put(t.sandbox, t, time.Now())
	}
	copyResponse(w, resp)
	return true
}
