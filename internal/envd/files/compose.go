package files

import (
	"encoding/json"
	"errors"
	"fmt"
	"io/fs"
	"net/http"
	"os"
	"path/filepath"
	"strings"

	"github.com/aenv-dev/aenv/internal/envd/filesystem"
	"github.com/aenv-dev/aenv/internal/envd/identity"
)

// ComposeRequest is POST /files/compose's body (E2B envd's ComposeRequest).
type ComposeRequest struct {
	SourcePaths []string `json:"source_paths"`
	Destination string   `json:"destination"`
	Username    string   `json:"username,omitempty"`
}

// Compose serves POST /files/compose: it concatenates the source files, in order, into the
// destination (kernel-side copies), then deletes the sources. The destination appears whole or not
// at all: it is assembled in a temporary file renamed into place, so a failure leaves an existing
// destination and every source as they were. The caller checks the access token.
func (h *Handler) Compose(w http.ResponseWriter, r *http.Request) {
	if r.Method != http.MethodPost {
		w.Header().Set("Allow", "POST")
		Error(w, http.StatusMethodNotAllowed, "method not allowed")
		return
	}
	var req ComposeRequest
	if err := json.NewDecoder(http.MaxBytesReader(w, r.Body, 1<<20)).Decode(&req); err != nil {
		Error(w, http.StatusBadRequest, "invalid request body: "+err.Error())
		return
	}
	if len(req.SourcePaths) == 0 {
		Error(w, http.StatusBadRequest, "source_paths must not be empty")
		return
	}
	if req.Destination == "" {
		Error(w, http.StatusBadRequest, "destination is required")
		return
	}
	snap := h.Defaults.Snapshot()
	name := req.Username
	if name == "" {
		name = snap.User
	}
	u, err := h.Users.Lookup(name)
	if err != nil {
		Error(w, http.StatusUnauthorized, fmt.Sprintf("invalid username: '%s'", name))
		return
	}
	dest := identity.Resolve(req.Destination, u, snap.Workdir)
	srcs := make([]string, len(req.SourcePaths))
	for i, s := range req.SourcePaths {
		p := identity.Resolve(s, u, snap.Workdir)
		if p == dest {
			Error(w, http.StatusBadRequest, fmt.Sprintf("source path %q cannot be the same as destination", s))
			return
		}
		fi, err := os.Stat(p)
		if err != nil {
			Error(w, http.StatusNotFound, "source file not found: "+s)
			return
		}
		if !fi.Mode().IsRegular() {
			Error(w, http.StatusBadRequest, "source path is not a regular file: "+s)
			return
		}
		srcs[i] = p
	}
	if fi, err := os.Stat(dest); err == nil && fi.IsDir() {
		Error(w, http.StatusBadRequest, fmt.Sprintf("path '%s' is a directory", dest))
		return
	}
	if err := compose(dest, srcs, int(u.UID), int(u.GID)); err != nil {
		writeError(w, err)
		return
	}
	for _, p := range srcs {
		if err := os.Remove(p); err != nil && !errors.Is(err, fs.ErrNotExist) && h.Logger != nil {
			h.Logger.Warn("compose: remove source", "path", p, "err", err)
		}
	}
	w.Header().Set("Content-Type", "application/json; charset=utf-8")
	_ = json.NewEncoder(w).Encode(WrittenFile{Path: dest, Name: filepath.Base(dest), Type: "file"})
}

// compose writes the concatenation of srcs to a temporary file next to dest, owned by uid:gid,
// and renames it over dest.
func compose(dest string, srcs []string, uid, gid int) error {
	if err := filesystem.MkdirAllOwned(filepath.Dir(dest), uid, gid); err != nil {
		return ioError(err, dest)
	}
	tmp, err := os.CreateTemp(filepath.Dir(dest), "."+strings.TrimPrefix(filepath.Base(dest), ".")+".compose-*")
	if err != nil {
		return ioError(err, dest)
	}
	ok := false
	defer func() {
		if !ok {
			tmp.Close()
			os.Remove(tmp.Name())
		}
	}()
	if err := tmp.Chmod(0o644); err != nil {
		return ioError(err, dest)
	}
	if os.Geteuid() == 0 {
		if err := tmp.Chown(uid, gid); err != nil {
			return ioError(err, dest)
		}
	}
	for _, p := range srcs {
		if err := appendFile(tmp, p); err != nil {
			return ioError(err, dest)
		}
	}
	if err := tmp.Close(); err != nil {
		return ioError(err, dest)
	}
	if err := os.Rename(tmp.Name(), dest); err != nil {
		return ioError(err, dest)
	}
	ok = true
	return nil
}

// appendFile copies src to the end of dst; between regular files ReadFrom uses copy_file_range,
// so the data never passes through user space.
func appendFile(dst *os.File, src string) error {
	f, err := os.Open(src)
	if err != nil {
		return err
	}
	defer f.Close()
	_, err = dst.ReadFrom(f)
	return err
}
