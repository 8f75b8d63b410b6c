package server

import (
	"context"
	"net/http"
	"time"

	"github.com/aenv-dev/aenv/internal/orchestrator"
	"github.com/aenv-dev/aenv/internal/server/api"
)

// logReader is implemented by orchestrators that keep sandbox logs; others answer 501.
type logReader interface {
	Logs(ctx context.Context, id string, q orchestrator.LogQuery) ([]orchestrator.LogEntry, error)
}

func (h *handlers) GetSandboxLogs(w http.ResponseWriter, r *http.Request, id api.SandboxID, params api.GetSandboxLogsParams) {
	if !validLogParams(w, "start", params.Start, params.Limit) {
		return
	}
	q := orchestrator.LogQuery{Forward: true}
	if params.Start != nil {
		q.Cursor = time.UnixMilli(*params.Start)
	}
	if params.Limit != nil {
		q.Limit = int(*params.Limit)
	}
	entries, ok := h.logs(w, r, id, q)
	if !ok {
		return
	}
	out := api.SandboxLogs{Logs: make([]api.SandboxLog, len(entries)), LogEntries: make([]api.SandboxLogEntry, len(entries))}
	for i, e := range entries {
		out.Logs[i] = api.SandboxLog{Timestamp: e.Time.UTC(), Line: e.Message}
		out.LogEntries[i] = logEntryBody(e)
	}
	writeJSON(w, http.StatusOK, out)
}

func (h *handlers) GetSandboxLogsV2(w http.ResponseWriter, r *http.Request, id api.SandboxID, params api.GetSandboxLogsV2Params) {
	if !validLogParams(w, "cursor", params.Cursor, params.Limit) {
		return
	}
	q := orchestrator.LogQuery{Forward: true}
	if params.Direction != nil {
		switch *params.Direction {
		case "forward":
		case "backward":
			q.Forward = false
		default:
			writeError(w, http.StatusBadRequest, "direction must be forward or backward, got %q", *params.Direction)
			return
		}
	}
	if params.Cursor != nil {
		q.Cursor = time.UnixMilli(*params.Cursor)
	}
	if params.Limit != nil {
		q.Limit = int(*params.Limit)
	}
	if params.Level != nil {
		q.MinLevel = string(*params.Level)
	}
	if params.Search != nil {
		q.Search = *params.Search
	}
	entries, ok := h.logs(w, r, id, q)
	if !ok {
		return
	}
	out := api.SandboxLogsV2Response{Logs: make([]api.SandboxLogEntry, len(entries))}
	for i, e := range entries {
		out.Logs[i] = logEntryBody(e)
	}
	writeJSON(w, http.StatusOK, out)
}

// validLogParams refuses a negative cursor or limit (the generated binder does not check
// the spec's minimum); on failure it answers 400 and returns false.
func validLogParams(w http.ResponseWriter, cursorName string, cursor *int64, limit *int32) bool {
	if cursor != nil && *cursor < 0 {
		writeError(w, http.StatusBadRequest, "%s must not be negative, got %d", cursorName, *cursor)
		return false
	}
	if limit != nil && *limit < 0 {
		writeError(w, http.StatusBadRequest, "limit must not be negative, got %d", *limit)
		return false
	}
	return true
}

// logs runs q; on failure it answers and returns false.
func (h *handlers) logs(w http.ResponseWriter, r *http.Request, id string, q orchestrator.LogQuery) ([]orchestrator.LogEntry, bool) {
	lr, ok := h.s.orch.(logReader)
	if !ok {
		writeError(w, http.StatusNotImplemented, "this node keeps no sandbox logs")
		return nil, false
	}
	entries, err := lr.Logs(r.Context(), id, q)
	if err != nil {
		writeOrchError(w, r, err)
		return nil, false
	}
	return entries, true
}

func logEntryBody(e orchestrator.LogEntry) api.SandboxLogEntry {
	fields := e.Fields
	if fields == nil {
		fields = map[string]string{}
	}
	return api.SandboxLogEntry{Timestamp: e.Time.UTC(), Level: api.LogLevel(e.Level), Message: e.Message, Fields: fields}
}
