package server

import (
	"errors"
	"fmt"
	"net/http"
	"path"
	"slices"
	"strings"
	"sync"

	"github.com/aenv-dev/aenv/internal/orchestrator"
	"github.com/aenv-dev/aenv/internal/server/api"
	"github.com/aenv-dev/aenv/internal/volume"
)

// VolumeStore is the node's volume store (*volume.Store).
type VolumeStore interface {
	Create(owner, name string) (volume.Volume, error)
	List(owner string) []volume.Volume
	Get(owner, idOrName string) (volume.Volume, error)
	Delete(owner, id string) error
	Token(v volume.Volume) string
	CheckToken(id, token string) (volume.Volume, error)
	Open(id string) (*volume.Content, error)
}

// volumeGuard orders creates that mount volumes against volume deletes: a create holds
// it shared while the sandbox starts, a delete exclusively while it checks that nothing
// mounts the volume and removes it, so a volume is never deleted under a starting sandbox.
type volumeGuard struct {
	store VolumeStore
	mu    sync.RWMutex
}

func newVolumeGuard(s VolumeStore) *volumeGuard {
	if s == nil {
		return nil
	}
	return &volumeGuard{store: s}
}

func (h *handlers) volumes(w http.ResponseWriter) (*volumeGuard, bool) {
	if h.s.vols == nil {
		writeError(w, http.StatusNotImplemented, "volumes are not enabled on this node")
		return nil, false
	}
	return h.s.vols, true
}

func writeVolumeError(w http.ResponseWriter, r *http.Request, err error) {
	switch {
	case errors.Is(err, volume.ErrNotFound), errors.Is(err, volume.ErrPathNotFound):
		writeError(w, http.StatusNotFound, "%s", err.Error())
	case errors.Is(err, volume.ErrExists), errors.Is(err, volume.ErrPathExists):
		writeError(w, http.StatusConflict, "%s", err.Error())
	case errors.Is(err, volume.ErrInvalid), errors.Is(err, volume.ErrQuota), errors.Is(err, volume.ErrIsDir):
		writeError(w, http.StatusBadRequest, "%s", err.Error())
	case errors.Is(err, volume.ErrNoSpace):
		writeError(w, http.StatusInsufficientStorage, "%s", err.Error())
	default:
		writeOrchError(w, r, err)
	}
}

func (g *volumeGuard) withToken(v volume.Volume) api.VolumeAndToken {
	return api.VolumeAndToken{VolumeID: v.ID, Name: v.Name, Token: g.store.Token(v)}
}

func (h *handlers) ListVolumes(w http.ResponseWriter, r *http.Request) {
	g, ok := h.volumes(w)
	if !ok {
		return
	}
	out := []api.Volume{}
	for _, v := range g.store.List(ownerFrom(r.Context())) {
		out = append(out, api.Volume{VolumeID: v.ID, Name: v.Name})
	}
	writeJSON(w, http.StatusOK, out)
}

func (h *handlers) CreateVolume(w http.ResponseWriter, r *http.Request) {
	g, ok := h.volumes(w)
	if !ok {
		return
	}
	var body api.NewVolume
	if !decodeRequired(w, r, &body) {
		return
	}
	v, err := g.store.Create(ownerFrom(r.Context()), body.Name)
	if err != nil {
		writeVolumeError(w, r, err)
		return
	}
	writeJSON(w, http.StatusCreated, g.withToken(v))
}

func (h *handlers) GetVolume(w http.ResponseWriter, r *http.Request, id api.VolumeID) {
	g, ok := h.volumes(w)
	if !ok {
		return
	}
	v, err := g.store.Get(ownerFrom(r.Context()), id)
	if err != nil {
		writeVolumeError(w, r, err)
		return
	}
	writeJSON(w, http.StatusOK, g.withToken(v))
}

func (h *handlers) DeleteVolume(w http.ResponseWriter, r *http.Request, id api.VolumeID) {
	g, ok := h.volumes(w)
	if !ok {
		return
	}
	owner := ownerFrom(r.Context())
	v, err := g.store.Get(owner, id)
	if err != nil {
		writeVolumeError(w, r, err)
		return
	}
	g.mu.Lock()
	defer g.mu.Unlock()
	users, err := h.s.volumeUsers(r, v.ID)
	if err != nil {
		writeOrchError(w, r, err)
		return
	}
	if len(users) > 0 {
		writeError(w, http.StatusConflict, "volume %q is mounted by sandbox(es) %s (running or paused); kill them first",
			v.Name, strings.Join(users, ", "))
		return
	}
	if err := g.store.Delete(owner, v.ID); err != nil {
		writeVolumeError(w, r, err)
		return
	}
	w.WriteHeader(http.StatusNoContent)
}

// volumeUsers are the sandboxes (running or paused) that mount volume id.
func (s *Server) volumeUsers(r *http.Request, id string) ([]string, error) {
	var users []string
	next := ""
	for {
		items, tok, err := s.orch.List(r.Context(), orchestrator.ListFilter{
			States: []string{"running", "paused"}, Limit: orchestrator.MaxListLimit, NextToken: next})
		if err != nil {
			return nil, err
		}
		for _, sb := range items {
			if slices.ContainsFunc(sb.VolumeMounts, func(m orchestrator.VolumeMount) bool { return m.VolumeID == id }) {
				users = append(users, sb.ID)
			}
		}
		if tok == "" {
			return users, nil
		}
		next = tok
	}
}

// volumeMounts resolves a create's volumeMounts (by name, in owner's scope).
func (s *Server) volumeMounts(owner string, in *[]api.SandboxVolumeMount) ([]orchestrator.VolumeMount, error) {
	if in == nil || len(*in) == 0 {
		return nil, nil
	}
	if s.vols == nil {
		return nil, fmt.Errorf("volumeMounts: volumes are not enabled on this node")
	}
	if len(*in) > orchestrator.MaxVolumeMounts {
		return nil, fmt.Errorf("volumeMounts: %d mounts; the limit is %d", len(*in), orchestrator.MaxVolumeMounts)
	}
	out := make([]orchestrator.VolumeMount, 0, len(*in))
	for _, m := range *in {
		if err := orchestrator.ValidMountPath(m.Path); err != nil {
			return nil, err
		}
		v, err := s.vols.store.Get(owner, m.Name)
		if err != nil {
			return nil, fmt.Errorf("volumeMounts: volume %q not found on node %q: volumes are node-local (not published to the "+
				"repository, never mounted from another node): create the sandbox through the API of the node that made the volume, "+
				"or create the volume here with POST /volumes", m.Name, s.node)
		}
		out = append(out, orchestrator.VolumeMount{Name: v.Name, Path: m.Path, VolumeID: v.ID})
	}
	return out, nil
}

func volumeMountsBody(in []orchestrator.VolumeMount) *[]api.SandboxVolumeMount {
	out := make([]api.SandboxVolumeMount, 0, len(in))
	for _, m := range in {
		out = append(out, api.SandboxVolumeMount{Name: m.Name, Path: m.Path})
	}
	return &out
}

// volumeContent authenticates a content request with the volume's token (Authorization:
// Bearer) and opens its content; on failure it has answered.
func (h *handlers) volumeContent(w http.ResponseWriter, r *http.Request, id string) (*volume.Content, bool) {
	g, ok := h.volumes(w)
	if !ok {
		return nil, false
	}
	tok, found := strings.CutPrefix(r.Header.Get("Authorization"), "Bearer ")
	if !found || tok == "" {
		writeError(w, http.StatusUnauthorized, "missing volume token: send it as Authorization: Bearer <token> (GET /volumes/{id} returns it)")
		return nil, false
	}
	v, err := g.store.CheckToken(id, tok)
	if err != nil {
		writeError(w, http.StatusUnauthorized, "invalid volume token for volume %q", id)
		return nil, false
	}
	c, err := g.store.Open(v.ID)
	if err != nil {
		writeVolumeError(w, r, err)
		return nil, false
	}
	return c, true
}

func entryBody(e volume.Entry) api.VolumeEntryStat {
	out := api.VolumeEntryStat{Name: e.Name, Path: e.Path, Type: api.VolumeEntryStatType(e.Type), Size: e.Size,
		Mode: e.Mode, Uid: e.UID, Gid: e.GID, Atime: e.Atime, Mtime: e.Mtime, Ctime: e.Ctime}
	if e.Target != "" {
		t := e.Target
		out.Target = &t
	}
	return out
}

func (h *handlers) ListVolumeDir(w http.ResponseWriter, r *http.Request, id api.VolumeID, p api.ListVolumeDirParams) {
	c, ok := h.volumeContent(w, r, id)
	if !ok {
		return
	}
	defer c.Close()
	depth := 1
	if p.Depth != nil {
		depth = *p.Depth
	}
	if depth < 1 || depth > 64 {
		writeError(w, http.StatusBadRequest, "depth must be between 1 and 64, got %d", depth)
		return
	}
	ents, err := c.List(p.Path, depth)
	if err != nil {
		writeVolumeError(w, r, err)
		return
	}
	out := make([]api.VolumeEntryStat, 0, len(ents))
	for _, e := range ents {
		out = append(out, entryBody(e))
	}
	writeJSON(w, http.StatusOK, out)
}

func (h *handlers) MakeVolumeDir(w http.ResponseWriter, r *http.Request, id api.VolumeID, p api.MakeVolumeDirParams) {
	c, ok := h.volumeContent(w, r, id)
	if !ok {
		return
	}
	defer c.Close()
	e, err := c.MakeDir(p.Path, p.Force != nil && *p.Force, volume.Owner{UID: p.Uid, GID: p.Gid, Mode: p.Mode})
	if err != nil {
		writeVolumeError(w, r, err)
		return
	}
	writeJSON(w, http.StatusCreated, entryBody(e))
}

func (h *handlers) StatVolumePath(w http.ResponseWriter, r *http.Request, id api.VolumeID, p api.StatVolumePathParams) {
	c, ok := h.volumeContent(w, r, id)
	if !ok {
		return
	}
	defer c.Close()
	e, err := c.Stat(p.Path)
	if err != nil {
		writeVolumeError(w, r, err)
		return
	}
	writeJSON(w, http.StatusOK, entryBody(e))
}

func (h *handlers) UpdateVolumePath(w http.ResponseWriter, r *http.Request, id api.VolumeID, p api.UpdateVolumePathParams) {
	c, ok := h.volumeContent(w, r, id)
	if !ok {
		return
	}
	defer c.Close()
	var body api.VolumeMetadataUpdate
	if !decodeRequired(w, r, &body) {
		return
	}
	e, err := c.SetAttr(p.Path, body.Uid, body.Gid, body.Mode)
	if err != nil {
		writeVolumeError(w, r, err)
		return
	}
	writeJSON(w, http.StatusOK, entryBody(e))
}

func (h *handlers) RemoveVolumePath(w http.ResponseWriter, r *http.Request, id api.VolumeID, p api.RemoveVolumePathParams) {
	c, ok := h.volumeContent(w, r, id)
	if !ok {
		return
	}
	defer c.Close()
	if err := c.Remove(p.Path); err != nil {
		writeVolumeError(w, r, err)
		return
	}
	w.WriteHeader(http.StatusNoContent)
}

func (h *handlers) ReadVolumeFile(w http.ResponseWriter, r *http.Request, id api.VolumeID, p api.ReadVolumeFileParams) {
	c, ok := h.volumeContent(w, r, id)
	if !ok {
		return
	}
	defer c.Close()
	f, fi, err := c.OpenFile(p.Path)
	if err != nil {
		writeVolumeError(w, r, err)
		return
	}
	defer f.Close()
	w.Header().Set("Content-Type", "application/octet-stream")
	http.ServeContent(w, r, path.Base(p.Path), fi.ModTime(), f)
}

func (h *handlers) WriteVolumeFile(w http.ResponseWriter, r *http.Request, id api.VolumeID, p api.WriteVolumeFileParams) {
	c, ok := h.volumeContent(w, r, id)
	if !ok {
		return
	}
	defer c.Close()
	e, err := c.WriteFile(p.Path, r.Body, volume.Owner{UID: p.Uid, GID: p.Gid, Mode: p.Mode})
	if err != nil {
		writeVolumeError(w, r, err)
		return
	}
	writeJSON(w, http.StatusOK, entryBody(e))
}
