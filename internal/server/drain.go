package server

import (
	"context"
	"encoding/json"
	"net/http"

	"github.com/aenv-dev/aenv/internal/server/api"
)

// Drainer drains a node of a cluster: no new placements, and with draining its running
// sandboxes are paused to disk, resumable on the other nodes.
type Drainer interface {
	Drain(ctx context.Context, draining bool) (DrainResult, error)
}

// DrainResult is the answer of POST /aenv/drain.
type DrainResult struct {
	Draining bool `json:"draining"`
	// Paused are the sandboxes the drain paused to disk.
	Paused []string `json:"paused"`
	// Failed are the sandboxes it could not pause, with why.
	Failed map[string]string `json:"failed,omitempty"`
}

// drainRoute is this node's id in its cluster and what drains it.
type drainRoute struct {
	nodeID string
	d      Drainer
}

// HandleDrain makes the node answer POST /aenv/drain ({"draining": bool}) and POST
// /nodes/{nodeID}/drain and /undrain for its own id through d. Only a node in a cluster
// calls it; the others answer 404 there.
func (s *Server) HandleDrain(nodeID string, d Drainer) {
	s.drain.Store(&drainRoute{nodeID: nodeID, d: d})
}

func (h *handlers) SetNodeDraining(w http.ResponseWriter, r *http.Request) {
	route := h.s.drain.Load()
	if route == nil {
		writeError(w, http.StatusNotFound, "this node is not in a cluster (start it with --scheduler): there is nothing to drain it from")
		return
	}
	var body struct {
		Draining *bool `json:"draining"`
	}
	if err := json.NewDecoder(http.MaxBytesReader(w, r.Body, 1<<10)).Decode(&body); err != nil || body.Draining == nil {
		writeError(w, http.StatusBadRequest, `the body must be {"draining": true|false}`)
		return
	}
	h.s.runDrain(w, r, route, *body.Draining)
}

func (h *handlers) DrainNode(w http.ResponseWriter, r *http.Request, nodeID api.NodeID) {
	h.drainNode(w, r, nodeID, true)
}

func (h *handlers) UndrainNode(w http.ResponseWriter, r *http.Request, nodeID api.NodeID) {
	h.drainNode(w, r, nodeID, false)
}

// drainNode serves the gateway's /nodes/{id}/(un)drain on a node: for its own id only.
func (h *handlers) drainNode(w http.ResponseWriter, r *http.Request, nodeID string, draining bool) {
	route := h.s.drain.Load()
	if route == nil || route.nodeID != nodeID {
		writeError(w, http.StatusNotFound, "node %q is not this node: drain nodes of a cluster at a gateway (POST /nodes/{id}/drain)", nodeID)
		return
	}
	h.s.runDrain(w, r, route, draining)
}

func (s *Server) runDrain(w http.ResponseWriter, r *http.Request, route *drainRoute, draining bool) {
	res, err := route.d.Drain(r.Context(), draining)
	if err != nil {
		writeError(w, http.StatusInternalServerError, "%v", err)
		return
	}
	writeJSON(w, http.StatusOK, res)
}
