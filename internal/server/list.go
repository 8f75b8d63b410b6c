package server

import (
	"context"
	"fmt"
	"net/http"
	"net/url"
	"strings"
	"time"

	"github.com/aenv-dev/aenv/internal/orchestrator"
	"github.com/aenv-dev/aenv/internal/server/api"
)

const (
	defaultListLimit = 100
	maxListLimit     = 100
)

func (h *handlers) ListSandboxesV2(w http.ResponseWriter, r *http.Request, p api.ListSandboxesV2Params) {
	f, err := listFilterV2(p)
	if err != nil {
		writeError(w, http.StatusBadRequest, "%s", err.Error())
		return
	}
	items, next, err := h.s.orch.List(r.Context(), f)
	if err != nil {
		writeOrchError(w, r, err)
		return
	}
	out := make([]api.ListedSandbox, 0, len(items))
	for _, sb := range items {
		out = append(out, listedBody(sb))
	}
	// The SDK sets hasNext = !!token, so the header is present only when more items exist.
	if next != "" {
		w.Header().Set("X-Next-Token", next)
	}
	writeJSON(w, http.StatusOK, out)
}

// listFilterV2 validates the v2 list query.
func listFilterV2(p api.ListSandboxesV2Params) (orchestrator.ListFilter, error) {
	f := orchestrator.ListFilter{Limit: defaultListLimit}
	if p.Metadata != nil {
		md, err := decodeMetadataFilter(*p.Metadata)
		if err != nil {
			return f, err
		}
		f.Metadata = md
	}
	if p.State != nil {
		for _, st := range *p.State {
			switch st {
			case api.Running, api.Paused:
				f.States = append(f.States, string(st))
			default:
				return f, fmt.Errorf("state must be 'running' or 'paused', got %q", st)
			}
		}
	}
	if p.StartedAfter != nil && *p.StartedAfter != "" {
		t, err := time.Parse(time.RFC3339Nano, *p.StartedAfter)
		if err != nil {
			return f, fmt.Errorf("startedAfter must be an RFC3339 time (e.g. 2026-01-02T15:04:05Z), got %q", *p.StartedAfter)
		}
		f.StartedAfter = t
	}
	if p.Template != nil {
		f.TemplateID = *p.Template
	}
	if p.Order != nil {
		switch *p.Order {
		case api.Asc:
			f.Ascending = true
		case api.Desc:
		default:
			return f, fmt.Errorf("order must be 'asc' or 'desc', got %q", *p.Order)
		}
	}
	if p.Limit != nil {
		if *p.Limit < 1 || *p.Limit > maxListLimit {
			return f, fmt.Errorf("limit must be between 1 and %d, got %d", maxListLimit, *p.Limit)
		}
		f.Limit = int(*p.Limit)
	}
	if p.NextToken != nil {
		f.NextToken = *p.NextToken
	}
	return f, nil
}

// ListSandboxesV1 is the deprecated list: running sandboxes only, no paging.
func (h *handlers) ListSandboxesV1(w http.ResponseWriter, r *http.Request, p api.ListSandboxesV1Params) {
	f := orchestrator.ListFilter{States: []string{"running"}}
	if p.Metadata != nil {
		md, err := decodeMetadataFilter(*p.Metadata)
		if err != nil {
			writeError(w, http.StatusBadRequest, "%s", err.Error())
			return
		}
		f.Metadata = md
	}
	items, err := listAll(r.Context(), h.s.orch, f)
	if err != nil {
		writeOrchError(w, r, err)
		return
	}
	out := make([]api.ListedSandbox, 0, len(items))
	for _, sb := range items {
		out = append(out, listedBody(sb))
	}
	writeJSON(w, http.StatusOK, out)
}

// listAll pages through every sandbox matching f.
func listAll(ctx context.Context, o Orchestrator, f orchestrator.ListFilter) ([]*orchestrator.Sandbox, error) {
	f.Limit = maxListLimit
	f.NextToken = ""
	var all []*orchestrator.Sandbox
	for {
		items, next, err := o.List(ctx, f)
		if err != nil {
			return nil, err
		}
		all = append(all, items...)
		if next == "" || len(items) == 0 {
			return all, nil
		}
		f.NextToken = next
	}
}

// decodeMetadataFilter decodes the metadata query parameter exactly as E2B's API does, so
// both SDKs' encodings work: the value (already decoded once by the query parser) is
// unescaped again, split on '&' into key=value pairs, and each key and value is unescaped.
// JS wire "user%3Da%252520b" → "user=a%2520b" → "user=a%20b" → {"user": "a b"}.
func decodeMetadataFilter(v string) (map[string]string, error) {
	if v == "" {
		return nil, nil
	}
	q, err := url.QueryUnescape(v)
	if err != nil {
		return nil, fmt.Errorf("metadata filter %q is not URL-encoded correctly: %w", v, err)
	}
	out := map[string]string{}
	for _, pair := range strings.Split(q, "&") {
		kv := strings.Split(pair, "=")
		if len(kv) != 2 {
			return nil, fmt.Errorf("metadata filter must be key=value pairs joined by '&', got %q", pair)
		}
		k, err := url.QueryUnescape(kv[0])
		if err != nil {
			return nil, fmt.Errorf("metadata filter key %q is not URL-encoded correctly: %w", kv[0], err)
		}
		val, err := url.QueryUnescape(kv[1])
		if err != nil {
			return nil, fmt.Errorf("metadata filter value %q is not URL-encoded correctly: %w", kv[1], err)
		}
		if k == "" {
			return nil, fmt.Errorf("metadata filter has an empty key in %q", pair)
		}
		out[k] = val
	}
	return out, nil
}
