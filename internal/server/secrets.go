package server

import (
	"errors"
	"fmt"
	"net/http"

	"github.com/aenv-dev/aenv/internal/secret"
	"github.com/aenv-dev/aenv/internal/server/api"
)

// SecretStore is the node's secret store (*secret.Store). No method returns a value
// except Expand, whose result goes to a sandbox only.
type SecretStore interface {
	Create(owner, name, value string, metadata map[string]string) (secret.Info, error)
	Update(owner, idOrName, value string, metadata map[string]string) (secret.Info, error)
	Get(owner, idOrName string) (secret.Info, error)
	List(owner string, limit int, nextToken string) ([]secret.Info, string, error)
	Delete(owner, idOrName string) error
	Expand(owner, value string) (string, error)
}

func (h *handlers) secrets(w http.ResponseWriter) (SecretStore, bool) {
	if h.s.secs == nil {
		writeError(w, http.StatusNotImplemented, "secrets are not enabled on this node")
		return nil, false
	}
	return h.s.secs, true
}

// writeSecretError answers a store error; its text names secrets, never values.
func writeSecretError(w http.ResponseWriter, r *http.Request, err error) {
	switch {
	case errors.Is(err, secret.ErrNotFound):
		writeError(w, http.StatusNotFound, "%s", err.Error())
	case errors.Is(err, secret.ErrExists):
		writeError(w, http.StatusConflict, "%s", err.Error())
	case errors.Is(err, secret.ErrInvalid):
		writeError(w, http.StatusBadRequest, "%s", err.Error())
	default:
		writeOrchError(w, r, err)
	}
}

func secretBody(i secret.Info) api.Secret {
	return api.Secret{SecretID: i.ID, Name: i.Name, CurrentVersion: i.Version, Metadata: api.SecretMetadata(i.Metadata),
		CreatedAt: i.CreatedAt, UpdatedAt: i.UpdatedAt}
}

func metadataOf(m *api.SecretMetadata) map[string]string {
	if m == nil {
		return nil
	}
	return *m
}

func (h *handlers) ListSecrets(w http.ResponseWriter, r *http.Request, p api.ListSecretsParams) {
	st, ok := h.secrets(w)
	if !ok {
		return
	}
	limit, next := 0, ""
	if p.Limit != nil {
		limit = int(*p.Limit)
		if limit < 1 {
			writeError(w, http.StatusBadRequest, "limit must be between 1 and %d", secret.MaxListLimit)
			return
		}
	}
	if p.NextToken != nil {
		next = *p.NextToken
	}
	items, tok, err := st.List(ownerFrom(r.Context()), limit, next)
	if err != nil {
		writeSecretError(w, r, err)
		return
	}
	out := make([]api.Secret, 0, len(items))
	for _, i := range items {
		out = append(out, secretBody(i))
	}
	if tok != "" {
		w.Header().Set("X-Next-Token", tok)
	}
	writeJSON(w, http.StatusOK, out)
}

func (h *handlers) CreateSecret(w http.ResponseWriter, r *http.Request) {
	st, ok := h.secrets(w)
	if !ok {
		return
	}
	var body api.NewSecret
	if !decodeRequired(w, r, &body) {
		return
	}
	i, err := st.Create(ownerFrom(r.Context()), body.Name, body.Value, metadataOf(body.Metadata))
	if err != nil {
		writeSecretError(w, r, err)
		return
	}
	writeJSON(w, http.StatusCreated, secretBody(i))
}

func (h *handlers) GetSecret(w http.ResponseWriter, r *http.Request, id string) {
	st, ok := h.secrets(w)
	if !ok {
		return
	}
	i, err := st.Get(ownerFrom(r.Context()), id)
	if err != nil {
		writeSecretError(w, r, err)
		return
	}
	writeJSON(w, http.StatusOK, secretBody(i))
}

func (h *handlers) UpdateSecret(w http.ResponseWriter, r *http.Request, id string) {
	st, ok := h.secrets(w)
	if !ok {
		return
	}
	var body api.SecretUpdate
	if !decodeRequired(w, r, &body) {
		return
	}
	i, err := st.Update(ownerFrom(r.Context()), id, body.Value, metadataOf(body.Metadata))
	if err != nil {
		writeSecretError(w, r, err)
		return
	}
	writeJSON(w, http.StatusOK, secretBody(i))
}

func (h *handlers) DeleteSecret(w http.ResponseWriter, r *http.Request, id string) {
	st, ok := h.secrets(w)
	if !ok {
		return
	}
	if err := st.Delete(ownerFrom(r.Context()), id); err != nil {
		writeSecretError(w, r, err)
		return
	}
	w.WriteHeader(http.StatusNoContent)
}

// checkSecretRefs makes sure every ${e2b.secrets.<name>} in a create's envVars (or a
// rule's headers) names one of owner's secrets, so a bad reference is a 400 before
// anything starts.
func (s *Server) checkSecretRefs(owner string, env map[string]string) error {
	for k, v := range env {
		if !secret.HasPlaceholder(v) {
			continue
		}
		if s.secs == nil {
			return fmt.Errorf("%s refers to a secret, but secrets are not enabled on this node", k)
		}
		if _, err := s.secs.Expand(owner, v); err != nil {
			return fmt.Errorf("%s: %w", k, err)
		}
	}
	return nil
}
