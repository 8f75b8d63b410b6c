package server

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net/http"

	"github.com/aenv-dev/aenv/internal/orchestrator"
	"github.com/aenv-dev/aenv/internal/server/api"
)

// maxBodyBytes bounds control-plane request bodies; E2B bodies are a few KiB at most.
const maxBodyBytes = 1 << 20

// writeJSON writes v with the given status. Encoding errors can only come from the
// connection at that point, so they are logged, not answered.
func writeJSON(w http.ResponseWriter, status int, v any) {
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(status)
	if err := json.NewEncoder(w).Encode(v); err != nil {
		slog.Debug("write response", "err", err)
	}
}

// writeError writes the E2B error body {"code": status, "message": msg}. The SDKs decide
// several outcomes on the body's code, so it always equals the HTTP status.
func writeError(w http.ResponseWriter, status int, format string, args ...any) {
	writeJSON(w, status, api.Error{Code: int32(status), Message: fmt.Sprintf(format, args...)})
}

// statusOf maps orchestrator sentinel errors onto HTTP statuses.
func statusOf(err error) int {
	switch {
	case errors.Is(err, orchestrator.ErrNotFound), errors.Is(err, orchestrator.ErrTemplateNotFound):
		return http.StatusNotFound
	case errors.Is(err, orchestrator.ErrConflict):
		return http.StatusConflict
	case errors.Is(err, orchestrator.ErrInvalid):
		return http.StatusBadRequest
	case errors.Is(err, orchestrator.ErrNotRunning):
		return http.StatusBadGateway
	case errors.Is(err, orchestrator.ErrCapacity), errors.Is(err, orchestrator.ErrTemplateNotReady):
		return http.StatusServiceUnavailable
	case errors.Is(err, orchestrator.ErrUnsupported):
		return http.StatusNotImplemented
	case errors.Is(err, context.DeadlineExceeded):
		return http.StatusGatewayTimeout
	default:
		return http.StatusInternalServerError
	}
}

// writeOrchError answers an orchestrator failure. Server errors are logged with the request
// so operators can find them; the client gets the error text either way.
func writeOrchError(w http.ResponseWriter, r *http.Request, err error) {
	status := statusOf(err)
	switch {
	case errors.Is(err, orchestrator.ErrCapacity), errors.Is(err, orchestrator.ErrTemplateNotReady):
		// A full or stopping node, a base still building: expected answers, not failures.
		slog.Warn("request refused", "method", r.Method, "path", r.URL.Path, "err", err)
	case status >= 500:
		slog.Error("request failed", "method", r.Method, "path", r.URL.Path, "err", err)
	}
	writeError(w, status, "%s", err.Error())
}

// errEmptyBody marks a request without a body, which optional-body endpoints accept.
var errEmptyBody = errors.New("empty body")

// decodeBody decodes a JSON request body into v. Unknown fields are accepted because the
// SDKs send fields (mcp, iam, ...) that aenv does not act on.
func decodeBody(r *http.Request, v any) error {
	body := http.MaxBytesReader(nil, r.Body, maxBodyBytes)
	dec := json.NewDecoder(body)
	if err := dec.Decode(v); err != nil {
		if errors.Is(err, io.EOF) {
			return errEmptyBody
		}
		var maxErr *http.MaxBytesError
		if errors.As(err, &maxErr) {
			return fmt.Errorf("request body is larger than %d bytes", maxBodyBytes)
		}
		return fmt.Errorf("request body is not valid JSON: %w", err)
	}
	if dec.More() {
		return errors.New("request body has trailing data after the JSON value")
	}
	return nil
}

// decodeRequired decodes a body that must be present; on failure it answers 400 and
// returns false.
func decodeRequired(w http.ResponseWriter, r *http.Request, v any) bool {
	if err := decodeBody(r, v); err != nil {
		if errors.Is(err, errEmptyBody) {
			writeError(w, http.StatusBadRequest, "request body is required")
			return false
		}
		writeError(w, http.StatusBadRequest, "%s", err.Error())
		return false
	}
	return true
}

// decodeOptional decodes a body that may be absent; on failure it answers 400 and returns
// false.
func decodeOptional(w http.ResponseWriter, r *http.Request, v any) bool {
	if err := decodeBody(r, v); err != nil && !errors.Is(err, errEmptyBody) {
		writeError(w, http.StatusBadRequest, "%s", err.Error())
		return false
	}
	return true
}
