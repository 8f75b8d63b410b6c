package server

import (
	"net/http"
	"time"

	"github.com/aenv-dev/aenv/internal/orchestrator"
	"github.com/aenv-dev/aenv/internal/server/api"
)

// defaultForkTimeout is E2B's default TTL of fork children (SandboxForkRequest.timeout).
const defaultForkTimeout = 15 * time.Second

func (h *handlers) CreateSandboxSnapshot(w http.ResponseWriter, r *http.Request, id api.SandboxID) {
	var body api.SandboxSnapshotRequest
	if !decodeOptional(w, r, &body) {
		return
	}
	name := ""
	if body.Name != nil {
		name = *body.Name
	}
	info, err := h.s.orch.Snapshot(r.Context(), id, name)
	if err != nil {
		writeOrchError(w, r, err)
		return
	}
	writeJSON(w, http.StatusCreated, snapshotBody(info))
}

func (h *handlers) ListSnapshots(w http.ResponseWriter, r *http.Request, p api.ListSnapshotsParams) {
	f := orchestrator.SnapshotFilter{Limit: defaultListLimit}
	if p.SandboxID != nil {
		f.SandboxID = *p.SandboxID
	}
	if p.Name != nil {
		f.Name = *p.Name
	}
	if p.Limit != nil {
		if *p.Limit < 1 || *p.Limit > maxListLimit {
			writeError(w, http.StatusBadRequest, "limit must be between 1 and %d, got %d", maxListLimit, *p.Limit)
			return
		}
		f.Limit = int(*p.Limit)
	}
	if p.NextToken != nil {
		f.NextToken = *p.NextToken
	}
	items, next, err := h.s.orch.ListSnapshots(r.Context(), f)
	if err != nil {
		writeOrchError(w, r, err)
		return
	}
	out := make([]api.SnapshotInfo, 0, len(items))
	for _, it := range items {
		out = append(out, snapshotBody(it))
	}
	if next != "" {
		w.Header().Set("X-Next-Token", next)
	}
	writeJSON(w, http.StatusOK, out)
}

func (h *handlers) DeleteTemplate(w http.ResponseWriter, r *http.Request, templateID string) {
	if h.deleteBuiltTemplate(w, r, templateID) {
		return
	}
	if err := h.s.orch.DeleteTemplate(r.Context(), templateID); err != nil {
		writeOrchError(w, r, err)
		return
	}
	w.WriteHeader(http.StatusNoContent)
}

func (h *handlers) ForkSandbox(w http.ResponseWriter, r *http.Request, id api.SandboxID) {
	var body api.SandboxForkRequest
	if !decodeOptional(w, r, &body) {
		return
	}
	count := 1
	if body.Count != nil {
		if *body.Count < 1 || *body.Count > orchestrator.MaxForkCount {
			writeError(w, http.StatusBadRequest, "count must be between 1 and %d, got %d", orchestrator.MaxForkCount, *body.Count)
			return
		}
		count = int(*body.Count)
	}
	timeout, err := h.s.timeoutSeconds(body.Timeout, defaultForkTimeout)
	if err != nil {
		writeError(w, http.StatusBadRequest, "%s", err.Error())
		return
	}
	results, err := h.s.orch.Fork(r.Context(), id, count, timeout)
	if err != nil {
		writeOrchError(w, r, err)
		return
	}
	out := make([]api.SandboxForkResult, len(results))
	for i, res := range results {
		if res.Err != nil || res.Sandbox == nil {
			status := http.StatusInternalServerError
			msg := "fork child was not started"
			if res.Err != nil {
				status, msg = statusOf(res.Err), res.Err.Error()
			}
			out[i].Error = &api.Error{Code: int32(status), Message: msg}
			continue
		}
		sb := h.s.sandboxBody(res.Sandbox)
		out[i].Sandbox = &sb
	}
	writeJSON(w, http.StatusCreated, out)
}

func (h *handlers) GetCapabilities(w http.ResponseWriter, r *http.Request) {
	c := h.s.orch.Capabilities()
	writeJSON(w, http.StatusOK, api.NodeCapabilities{
		Backend:             h.s.orch.BackendName(),
		Snapshots:           c.Snapshots,
		MemorySnapshots:     c.MemorySnapshots,
		PauseKeepsProcesses: c.PauseKeepsProcesses,
		PauseReleasesMemory: c.PauseReleasesMemory,
		LiveFork:            c.LiveFork,
	})
}

func snapshotBody(info orchestrator.SnapshotInfo) api.SnapshotInfo {
	out := api.SnapshotInfo{SnapshotID: info.SnapshotID, Names: info.Names}
	if out.Names == nil {
		out.Names = []string{}
	}
	if info.SourceSandboxID != "" {
		v := info.SourceSandboxID
		out.SourceSandboxID = &v
	}
	if info.ParentID != "" {
		v := info.ParentID
		out.ParentID = &v
	}
	if !info.CreatedAt.IsZero() {
		t := info.CreatedAt.UTC()
		out.CreatedAt = &t
	}
	return out
}
