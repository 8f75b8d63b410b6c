package server

import (
	"context"
	"encoding/json"
	"net/http"
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

// HandleDrain serves POST /aenv/drain ({"draining": bool}, API key required) through d.
// Only a node in a cluster has it.
func (s *Server) HandleDrain(d Drainer) {
	s.mux.HandleFunc("POST /aenv/drain", func(w http.ResponseWriter, r *http.Request) {
		key := r.Header.Get("X-API-Key")
		ok, err := s.auth.Authenticate(r.Context(), key)
		if err != nil {
			writeError(w, http.StatusInternalServerError, "checking the API key failed: %v", err)
			return
		}
		if key == "" || !ok {
			writeError(w, http.StatusUnauthorized, "missing or invalid API key (X-API-Key)")
			return
		}
		var body struct {
			Draining *bool `json:"draining"`
		}
		if err := json.NewDecoder(http.MaxBytesReader(w, r.Body, 1<<10)).Decode(&body); err != nil || body.Draining == nil {
			writeError(w, http.StatusBadRequest, `the body must be {"draining": true|false}`)
			return
		}
		res, err := d.Drain(r.Context(), *body.Draining)
		if err != nil {
			writeError(w, http.StatusInternalServerError, "%v", err)
			return
		}
		writeJSON(w, http.StatusOK, res)
	})
}
