package server

import (
	"errors"
	"fmt"
	"net/http"
	"slices"
	"time"

	"github.com/aenv-dev/aenv/internal/image"
	"github.com/aenv-dev/aenv/internal/server/api"
)

func (h *handlers) AssignTemplateTags(w http.ResponseWriter, r *http.Request) {
	b, ok := h.builder(w)
	if !ok {
		return
	}
	var body api.AssignTemplateTagsRequest
	if !decodeRequired(w, r, &body) {
		return
	}
	buildID, tags, err := b.AssignTags(body.Target, body.Tags)
	if err != nil {
		writeBuildError(w, r, err)
		return
	}
	writeJSON(w, http.StatusCreated, api.AssignedTemplateTags{BuildID: buildID, Tags: tags})
}

func (h *handlers) DeleteTemplateTags(w http.ResponseWriter, r *http.Request) {
	b, ok := h.builder(w)
	if !ok {
		return
	}
	var body api.DeleteTemplateTagsRequest
	if !decodeRequired(w, r, &body) {
		return
	}
	if err := b.RemoveTags(body.Name, body.Tags); err != nil {
		writeBuildError(w, r, err)
		return
	}
	w.WriteHeader(http.StatusNoContent)
}

func (h *handlers) ListTemplateTags(w http.ResponseWriter, r *http.Request, templateID api.TemplateID) {
	b, ok := h.builder(w)
	if !ok {
		return
	}
	tags, err := b.Tags(templateID)
	if err != nil {
		writeBuildError(w, r, err)
		return
	}
	out := make([]api.TemplateTag, 0, len(tags))
	for _, t := range tags {
		out = append(out, api.TemplateTag{Tag: t.Tag, BuildID: t.BuildID, CreatedAt: t.CreatedAt})
	}
	writeJSON(w, http.StatusOK, out)
}

// Limits of GET /templates/{id}/builds/{buildID}/logs, as E2B's API has them.
const (
	defaultBuildLogsLimit = 100
	maxBuildLogsLimit     = 1000
)

func (h *handlers) GetTemplateBuildLogs(w http.ResponseWriter, r *http.Request, templateID api.TemplateID, buildID api.BuildID, p api.GetTemplateBuildLogsParams) {
	b, ok := h.builder(w)
	if !ok {
		return
	}
	limit := defaultBuildLogsLimit
	if p.Limit != nil {
		if *p.Limit < 0 || *p.Limit > maxBuildLogsLimit {
			writeError(w, http.StatusBadRequest, "limit must be between 0 and %d, got %d", maxBuildLogsLimit, *p.Limit)
			return
		}
		limit = int(*p.Limit)
	}
	if p.Cursor != nil && *p.Cursor < 0 {
		writeError(w, http.StatusBadRequest, "cursor must not be negative")
		return
	}
	backward := false
	if p.Direction != nil {
		switch *p.Direction {
		case api.Forward:
		case api.Backward:
			backward = true
		default:
			writeError(w, http.StatusBadRequest, "direction must be forward or backward, got %q", *p.Direction)
			return
		}
	}
	if p.Source != nil && *p.Source != api.Temporary && *p.Source != api.Persistent {
		writeError(w, http.StatusBadRequest, "source must be temporary or persistent, got %q", *p.Source)
		return
	}
	if p.Level != nil {
		if _, ok := logLevels[string(*p.Level)]; !ok {
			writeError(w, http.StatusBadRequest, "level must be debug, info, warn or error, got %q", *p.Level)
			return
		}
	}
	if _, err := b.Get(templateID, buildID); err != nil {
		writeBuildError(w, r, err)
		return
	}
	all := b.Logs(buildID, 0, 0)
	if backward {
		all = slices.Clone(all)
		slices.Reverse(all)
	}
	var cursor time.Time
	if p.Cursor != nil {
		cursor = time.UnixMilli(*p.Cursor)
	}
	out := api.TemplateBuildLogsResponse{Logs: []api.BuildLogEntry{}}
	for _, e := range all {
		if len(out.Logs) >= limit {
			break
		}
		if p.Cursor != nil && (!backward && e.Timestamp.Before(cursor) || backward && e.Timestamp.After(cursor)) {
			continue
		}
		if p.Level != nil && logLevels[e.Level] < logLevels[string(*p.Level)] {
			continue
		}
		out.Logs = append(out.Logs, logEntry(e))
	}
	writeJSON(w, http.StatusOK, out)
}

// registryCredentials reads E2B's FromImageRegistry union: only the generic "registry"
// type (username and password) is acted on; the cloud ones would need their SDKs to mint
// tokens, which a node does with a docker credential helper instead.
func registryCredentials(m map[string]any) (image.Credentials, error) {
	str := func(k string) string {
		s, _ := m[k].(string)
		return s
	}
	switch t := str("type"); t {
	case "registry":
		c := image.Credentials{Username: str("username"), Password: str("password")}
		if c.Username == "" || c.Password == "" {
			return c, errors.New(`type "registry" needs a username and a password`)
		}
		return c, nil
	case "aws", "gcp":
		return image.Credentials{}, fmt.Errorf("%s registry credentials are not supported: give %q credentials "+
			"(username and password), or configure a docker credential helper in the node's docker config file", t, "registry")
	case "":
		return image.Credentials{}, errors.New(`type is required ("registry")`)
	default:
		return image.Credentials{}, fmt.Errorf("unknown type %q (supported: \"registry\")", t)
	}
}
