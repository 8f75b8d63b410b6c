package server

import (
	"errors"
	"net/http"
	"strings"

	"github.com/aenv-dev/aenv/internal/catalog"
	"github.com/aenv-dev/aenv/internal/server/api"
)

// KeyManager manages API keys (the catalog's *catalog.APIKeys).
type KeyManager interface {
	Create(name string) (string, catalog.APIKey, error)
	List() ([]catalog.APIKey, error)
	Revoke(idOrName string) (catalog.APIKey, error)
}

func (h *handlers) keys(w http.ResponseWriter) (KeyManager, bool) {
	if h.s.keys == nil {
		writeError(w, http.StatusNotFound, "API key management is not enabled on this node")
		return nil, false
	}
	return h.s.keys, true
}

func (h *handlers) ListAPIKeys(w http.ResponseWriter, r *http.Request) {
	km, ok := h.keys(w)
	if !ok {
		return
	}
	keys, err := km.List()
	if err != nil {
		writeOrchError(w, r, err)
		return
	}
	out := make([]api.APIKeyInfo, 0, len(keys))
	for _, k := range keys {
		info := api.APIKeyInfo{Id: k.ID, Name: k.Name, Prefix: k.Prefix, CreatedAt: k.CreatedAt}
		if !k.LastUsed.IsZero() {
			lu := k.LastUsed
			info.LastUsed = &lu
		}
		out = append(out, info)
	}
	writeJSON(w, http.StatusOK, out)
}

func (h *handlers) CreateAPIKey(w http.ResponseWriter, r *http.Request) {
	km, ok := h.keys(w)
	if !ok {
		return
	}
	var body api.NewAPIKey
	if !decodeRequired(w, r, &body) {
		return
	}
	name := strings.TrimSpace(body.Name)
	if name == "" || len(name) > 128 {
		writeError(w, http.StatusBadRequest, "name is required (1 to 128 characters)")
		return
	}
	key, rec, err := km.Create(name)
	if err != nil {
		writeKeyError(w, r, err)
		return
	}
	writeJSON(w, http.StatusCreated, api.CreatedAPIKey{Id: rec.ID, Name: rec.Name, Prefix: rec.Prefix, CreatedAt: rec.CreatedAt, Key: key})
}

func (h *handlers) RevokeAPIKey(w http.ResponseWriter, r *http.Request, keyID string) {
	km, ok := h.keys(w)
	if !ok {
		return
	}
	// Revoking the last key would lock everyone out of the API.
	keys, err := km.List()
	if err != nil {
		writeKeyError(w, r, err)
		return
	}
	if len(keys) == 1 && (keys[0].ID == keyID || keys[0].Name == keyID) {
		writeError(w, http.StatusConflict, "refusing to revoke the last API key; create another one first")
		return
	}
	if _, err := km.Revoke(keyID); err != nil {
		writeKeyError(w, r, err)
		return
	}
	w.WriteHeader(http.StatusNoContent)
}

func writeKeyError(w http.ResponseWriter, r *http.Request, err error) {
	switch {
	case errors.Is(err, catalog.ErrNotFound):
		writeError(w, http.StatusNotFound, "%s", err.Error())
	case errors.Is(err, catalog.ErrInvalid):
		writeError(w, http.StatusBadRequest, "%s", err.Error())
	default:
		writeOrchError(w, r, err)
	}
}
