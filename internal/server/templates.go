package server

import (
	"cmp"
	"context"
	"crypto/hmac"
	"crypto/sha256"
	"encoding/base64"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/url"
	"slices"
	"strconv"
	"time"

	"github.com/aenv-dev/aenv/internal/catalog"
	"github.com/aenv-dev/aenv/internal/sandbox"
	"github.com/aenv-dev/aenv/internal/server/api"
	"github.com/aenv-dev/aenv/internal/template/build"
)

// TemplateBuilder is what the template endpoints need from the node's builder
// (*build.Service).
type TemplateBuilder interface {
	Request(ctx context.Context, o build.RequestOptions) (build.Record, error)
	Start(ctx context.Context, templateID, buildID string, spec build.Spec) error
	Get(templateID, buildID string) (build.Record, error)
	Logs(buildID string, offset, limit int) []build.LogEntry
	Builds(templateID string) []build.Record
	FilePresent(hash string) (bool, error)
	PutFile(hash string, r io.Reader) error
	Templates() ([]catalog.Template, error)
	Resolve(idOrAlias string) (catalog.Template, error)
	Delete(ctx context.Context, idOrAlias string) (catalog.Template, error)
	AssignTags(target string, tags []string) (buildID string, assigned []string, err error)
	RemoveTags(name string, tags []string) error
	Tags(idOrAlias string) ([]build.Tag, error)
	ResolveTag(nameTag string) (catalog.Template, error)
}

// uploadURLTTL is how long an upload URL from GET /templates/{id}/files/{hash} is valid.
const uploadURLTTL = time.Hour

func (h *handlers) builder(w http.ResponseWriter) (TemplateBuilder, bool) {
	if h.s.builds == nil {
		writeError(w, http.StatusNotImplemented, "template builds are not enabled on this node")
		return nil, false
	}
	return h.s.builds, true
}

// writeBuildError maps builder sentinel errors onto HTTP statuses.
func writeBuildError(w http.ResponseWriter, r *http.Request, err error) {
	switch {
	case errors.Is(err, build.ErrNotFound), errors.Is(err, catalog.ErrNotFound):
		writeError(w, http.StatusNotFound, "%s", err.Error())
	case errors.Is(err, build.ErrInvalidSpec), errors.Is(err, catalog.ErrInvalid):
		writeError(w, http.StatusBadRequest, "%s", err.Error())
	case errors.Is(err, build.ErrConflict), errors.Is(err, catalog.ErrAliasTaken):
		writeError(w, http.StatusConflict, "%s", err.Error())
	case errors.Is(err, build.ErrTooLarge):
		writeError(w, http.StatusRequestEntityTooLarge, "%s", err.Error())
	default:
		writeOrchError(w, r, err)
	}
}

func (h *handlers) RequestTemplateBuildV3(w http.ResponseWriter, r *http.Request) {
	b, ok := h.builder(w)
	if !ok {
		return
	}
	var body api.TemplateBuildRequestV3
	if !decodeRequired(w, r, &body) {
		return
	}
	name := deref(body.Name)
	if name == "" {
		name = deref(body.Alias)
	}
	if name == "" {
		writeError(w, http.StatusBadRequest, "name is required")
		return
	}
	o := build.RequestOptions{Name: name, Resources: sandbox.Resources{
		CPUCount: int(derefInt(body.CpuCount)), MemoryMB: int(derefInt(body.MemoryMB))}}
	if err := h.s.capacity.Check(o.Resources); err != nil {
		writeError(w, http.StatusBadRequest, "%s", err.Error())
		return
	}
	if body.Tags != nil {
		o.Tags = *body.Tags
	}
	rec, err := b.Request(r.Context(), o)
	if err != nil {
		writeBuildError(w, r, err)
		return
	}
	tags := rec.Tags
	if tags == nil {
		tags = []string{}
	}
	writeJSON(w, http.StatusAccepted, api.TemplateRequestResponseV3{TemplateID: rec.TemplateID, BuildID: rec.ID,
		Names: []string{rec.Name}, Aliases: []string{rec.Name}, Tags: tags})
}

func (h *handlers) GetTemplateFileUpload(w http.ResponseWriter, r *http.Request, templateID api.TemplateID, hash string) {
	b, ok := h.builder(w)
	if !ok {
		return
	}
	if !h.knownTemplate(b, templateID) {
		writeError(w, http.StatusNotFound, "template %q not found", templateID)
		return
	}
	present, err := b.FilePresent(hash)
	if err != nil {
		writeBuildError(w, r, err)
		return
	}
	resp := api.TemplateBuildFileUpload{Present: present}
	if !present {
		u := h.s.uploadURL(r, hash, time.Now().Add(uploadURLTTL))
		resp.Url = &u
	}
	writeJSON(w, http.StatusCreated, resp)
}

// knownTemplate reports whether id is a template or has a build (a template that is
// still being built for the first time exists only as build records).
func (h *handlers) knownTemplate(b TemplateBuilder, id string) bool {
	if _, err := b.Resolve(id); err == nil {
		return true
	}
	return len(b.Builds(id)) > 0
}

// uploadURL is an absolute, signed URL on this node for PUTting a file set: the SDKs
// send no API key there.
func (s *Server) uploadURL(r *http.Request, hash string, exp time.Time) string {
	scheme := "http"
	if r.TLS != nil || r.Header.Get("X-Forwarded-Proto") == "https" {
		scheme = "https"
	}
	q := url.Values{"expires": {strconv.FormatInt(exp.Unix(), 10)}, "token": {s.uploadToken(hash, exp.Unix())}}
	return scheme + "://" + r.Host + "/aenv/uploads/" + url.PathEscape(hash) + "?" + q.Encode()
}

func (s *Server) uploadToken(hash string, exp int64) string {
	m := hmac.New(sha256.New, s.uploadKey)
	fmt.Fprintf(m, "%s\n%d", hash, exp)
	return base64.RawURLEncoding.EncodeToString(m.Sum(nil))
}

func (h *handlers) UploadTemplateFiles(w http.ResponseWriter, r *http.Request, hash string, p api.UploadTemplateFilesParams) {
	b, ok := h.builder(w)
	if !ok {
		return
	}
	if !hmac.Equal([]byte(p.Token), []byte(h.s.uploadToken(hash, p.Expires))) {
		writeError(w, http.StatusUnauthorized, "invalid upload token")
		return
	}
	if time.Now().Unix() > p.Expires {
		writeError(w, http.StatusUnauthorized, "the upload URL expired; ask for a new one")
		return
	}
	if err := b.PutFile(hash, r.Body); err != nil {
		writeBuildError(w, r, err)
		return
	}
	w.WriteHeader(http.StatusCreated)
}

func (h *handlers) StartTemplateBuildV2(w http.ResponseWriter, r *http.Request, templateID api.TemplateID, buildID api.BuildID) {
	b, ok := h.builder(w)
	if !ok {
		return
	}
	var body api.TemplateBuildStartV2
	if !decodeRequired(w, r, &body) {
		return
	}
	spec := build.Spec{FromImage: deref(body.FromImage), FromTemplate: deref(body.FromTemplate),
		StartCmd: deref(body.StartCmd), ReadyCmd: deref(body.ReadyCmd), Force: body.Force != nil && *body.Force}
	if body.FromImageRegistry != nil {
		creds, err := registryCredentials(*body.FromImageRegistry)
		if err != nil {
			writeError(w, http.StatusBadRequest, "fromImageRegistry: %s", err.Error())
			return
		}
		spec.Registry = &creds
	}
	if body.Steps != nil {
		for _, st := range *body.Steps {
			s := build.Step{Type: st.Type, FilesHash: deref(st.FilesHash), Force: st.Force != nil && *st.Force}
			if st.Args != nil {
				s.Args = *st.Args
			}
			spec.Steps = append(spec.Steps, s)
		}
	}
	if err := b.Start(r.Context(), templateID, buildID, spec); err != nil {
		writeBuildError(w, r, err)
		return
	}
	w.WriteHeader(http.StatusAccepted)
}

var logLevels = map[string]int{"debug": 0, "info": 1, "warn": 2, "error": 3}

func (h *handlers) GetTemplateBuildStatus(w http.ResponseWriter, r *http.Request, templateID api.TemplateID, buildID api.BuildID, p api.GetTemplateBuildStatusParams) {
	b, ok := h.builder(w)
	if !ok {
		return
	}
	offset, limit := int(derefInt(p.LogsOffset)), int(derefInt(p.Limit))
	if offset < 0 || limit < 0 {
		writeError(w, http.StatusBadRequest, "logsOffset and limit must not be negative")
		return
	}
	rec, err := b.Get(templateID, buildID)
	if err != nil {
		writeBuildError(w, r, err)
		return
	}
	entries := b.Logs(buildID, offset, limit)
	out := api.TemplateBuildInfo{TemplateID: rec.TemplateID, BuildID: rec.ID, Status: api.TemplateBuildStatus(rec.Status),
		Logs: []string{}, LogEntries: []api.BuildLogEntry{}}
	off := int32(offset)
	out.LogsOffset = &off
	for _, e := range entries {
		if p.Level != nil && logLevels[e.Level] < logLevels[string(*p.Level)] {
			continue
		}
		out.LogEntries = append(out.LogEntries, logEntry(e))
		out.Logs = append(out.Logs, fmt.Sprintf("[%s] %s\n", e.Timestamp.Format(time.RFC3339), e.Message))
	}
	if rec.Reason != nil {
		reason := &api.BuildStatusReason{Message: rec.Reason.Message}
		if rec.Reason.Step != "" {
			reason.Step = &rec.Reason.Step
		}
		var errs []api.BuildLogEntry
		for _, e := range b.Logs(buildID, 0, 0) {
			if e.Level == "error" {
				errs = append(errs, logEntry(e))
			}
		}
		reason.LogEntries = &errs
		out.Reason = reason
	}
	writeJSON(w, http.StatusOK, out)
}

func logEntry(e build.LogEntry) api.BuildLogEntry {
	lvl := api.LogLevel(e.Level)
	if _, ok := logLevels[e.Level]; !ok {
		lvl = api.LogLevelInfo
	}
	return api.BuildLogEntry{Timestamp: e.Timestamp, Level: lvl, Message: e.Message}
}

// templateViews lists templates with their latest build, including templates whose
// first build has not finished (they exist only as build records).
func templateViews(b TemplateBuilder, def sandbox.Resources) ([]api.Template, error) {
	ts, err := b.Templates()
	if err != nil {
		return nil, err
	}
	byTemplate := map[string][]build.Record{}
	var order []string
	for _, rec := range b.Builds("") {
		if _, seen := byTemplate[rec.TemplateID]; !seen {
			order = append(order, rec.TemplateID)
		}
		byTemplate[rec.TemplateID] = append(byTemplate[rec.TemplateID], rec)
	}
	out := make([]api.Template, 0, len(ts))
	registered := map[string]bool{}
	for _, t := range ts {
		registered[t.ID] = true
		out = append(out, templateView(t, byTemplate[t.ID], def))
	}
	for _, id := range order {
		if registered[id] {
			continue
		}
		recs := byTemplate[id]
		last := recs[len(recs)-1]
		out = append(out, templateView(catalog.Template{ID: id, Aliases: []string{last.Name}, Resources: last.Resources,
			CreatedAt: recs[0].CreatedAt}, recs, def))
	}
	return out, nil
}

// templateView describes t; resources it leaves unset are reported as def, what sandboxes
// created from it get.
func templateView(t catalog.Template, recs []build.Record, def sandbox.Resources) api.Template {
	t.Resources.CPUCount = cmp.Or(t.Resources.CPUCount, def.CPUCount)
	t.Resources.MemoryMB = cmp.Or(t.Resources.MemoryMB, def.MemoryMB)
	t.Resources.DiskSizeMB = cmp.Or(t.Resources.DiskSizeMB, def.DiskSizeMB)
	aliases := slices.Clone(t.Aliases)
	if aliases == nil {
		aliases = []string{}
	}
	v := api.Template{TemplateID: t.ID, Aliases: aliases, Names: aliases, BuildStatus: api.TemplateBuildStatusReady,
		CpuCount: int32(t.Resources.CPUCount), MemoryMB: int32(t.Resources.MemoryMB), DiskSizeMB: int32(t.Resources.DiskSizeMB),
		CreatedAt: t.CreatedAt, UpdatedAt: t.CreatedAt, BuildCount: int32(len(recs))}
	if len(recs) > 0 {
		last := recs[len(recs)-1]
		v.BuildID, v.BuildStatus, v.UpdatedAt = last.ID, api.TemplateBuildStatus(last.Status), last.UpdatedAt
	}
	return v
}

func (h *handlers) ListTemplates(w http.ResponseWriter, r *http.Request, _ api.ListTemplatesParams) {
	b, ok := h.builder(w)
	if !ok {
		return
	}
	out, err := templateViews(b, h.defaultResources())
	if err != nil {
		writeOrchError(w, r, err)
		return
	}
	writeJSON(w, http.StatusOK, out)
}

func (h *handlers) ListTemplatesV2(w http.ResponseWriter, r *http.Request, p api.ListTemplatesV2Params) {
	b, ok := h.builder(w)
	if !ok {
		return
	}
	limit := 100
	if p.Limit != nil {
		if *p.Limit < 1 || *p.Limit > 100 {
			writeError(w, http.StatusBadRequest, "limit must be between 1 and 100, got %d", *p.Limit)
			return
		}
		limit = int(*p.Limit)
	}
	start := 0
	if tok := deref(p.NextToken); tok != "" {
		n, err := strconv.Atoi(tok)
		if err != nil || n < 0 {
			writeError(w, http.StatusBadRequest, "invalid nextToken %q", tok)
			return
		}
		start = n
	}
	all, err := templateViews(b, h.defaultResources())
	if err != nil {
		writeOrchError(w, r, err)
		return
	}
	page := all[min(start, len(all)):min(start+limit, len(all))]
	if start+limit < len(all) {
		w.Header().Set("X-Next-Token", strconv.Itoa(start+limit))
	}
	writeJSON(w, http.StatusOK, page)
}

func (h *handlers) GetTemplate(w http.ResponseWriter, r *http.Request, templateID string, _ api.GetTemplateParams) {
	b, ok := h.builder(w)
	if !ok {
		return
	}
	t, err := b.Resolve(templateID)
	var recs []build.Record
	switch {
	case err == nil:
		recs = b.Builds(t.ID)
	case errors.Is(err, build.ErrNotFound):
		if recs = unbuiltBuilds(b, templateID); len(recs) == 0 {
			writeBuildError(w, r, err)
			return
		}
		last := recs[len(recs)-1]
		t = catalog.Template{ID: last.TemplateID, Aliases: []string{last.Name}, CreatedAt: recs[0].CreatedAt}
	default:
		writeBuildError(w, r, err)
		return
	}
	v := templateView(t, recs, h.defaultResources())
	out := api.TemplateWithBuilds{TemplateID: t.ID, Aliases: v.Aliases, Names: v.Names, CreatedAt: v.CreatedAt,
		UpdatedAt: v.UpdatedAt, Builds: []api.TemplateBuild{}}
	for _, rec := range recs {
		tb := api.TemplateBuild{BuildID: rec.ID, Status: api.TemplateBuildStatus(rec.Status), CreatedAt: rec.CreatedAt,
			UpdatedAt: rec.UpdatedAt, CpuCount: int32(rec.Resources.CPUCount), MemoryMB: int32(rec.Resources.MemoryMB)}
		if d := int32(rec.Resources.DiskSizeMB); d > 0 {
			tb.DiskSizeMB = &d
		}
		if !rec.FinishedAt.IsZero() {
			f := rec.FinishedAt
			tb.FinishedAt = &f
		}
		out.Builds = append(out.Builds, tb)
	}
	writeJSON(w, http.StatusOK, out)
}

// unbuiltBuilds returns the builds of a template that exists only as build records (its
// builds failed, or none has finished), found by id or by the name it was requested
// under, as the catalog finds a registered one.
func unbuiltBuilds(b TemplateBuilder, idOrName string) []build.Record {
	if recs := b.Builds(idOrName); len(recs) > 0 {
		return recs
	}
	id := ""
	for _, rec := range b.Builds("") {
		if rec.Name == idOrName {
			id = rec.TemplateID
		}
	}
	if id == "" {
		return nil
	}
	return b.Builds(id)
}

func (h *handlers) GetTemplateAlias(w http.ResponseWriter, r *http.Request, alias string) {
	b, ok := h.builder(w)
	if !ok {
		return
	}
	// Template.exists("name:tag") asks for a tagged build.
	t, err := b.ResolveTag(alias)
	if err != nil {
		writeBuildError(w, r, err)
		return
	}
	writeJSON(w, http.StatusOK, api.TemplateAliasResponse{TemplateID: t.ID})
}

// deleteBuiltTemplate deletes a template through the builder, which also removes its
// builds and files. It reports false when the name is not a template it handles
// (snapshots, unknown names): DeleteTemplate then goes on with the orchestrator.
func (h *handlers) deleteBuiltTemplate(w http.ResponseWriter, r *http.Request, id string) bool {
	if h.s.builds == nil {
		return false
	}
	_, err := h.s.builds.Delete(r.Context(), id)
	switch {
	case err == nil:
		w.WriteHeader(http.StatusNoContent)
		return true
	case errors.Is(err, build.ErrNotTemplate), errors.Is(err, build.ErrNotFound):
		return false
	default:
		writeBuildError(w, r, err)
		return true
	}
}

func deref(s *string) string {
	if s == nil {
		return ""
	}
	return *s
}

func derefInt(v *int32) int32 {
	if v == nil {
		return 0
	}
	return *v
}

// defaultResources are what a sandbox gets for resources neither its request nor its
// template sets.
func (h *handlers) defaultResources() sandbox.Resources {
	return h.s.orch.Config().DefaultResources
}
