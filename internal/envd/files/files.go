// Package files serves envd's plain-HTTP /files endpoint: downloads (ranges, conditional requests,
// gzip on request) and uploads (multipart with full relative file names, or raw octet-stream,
// optionally gzip-encoded), authorised by the access token or by a v1 signature.
package files

import (
	"bufio"
	"compress/gzip"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"log/slog"
	"mime"
	"mime/multipart"
	"net/http"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"time"

	"github.com/aenv-dev/aenv/internal/envd/filesystem"
	"github.com/aenv-dev/aenv/internal/envd/identity"
	"github.com/aenv-dev/aenv/internal/envd/state"
)

// Handler serves GET and POST /files.
type Handler struct {
	Defaults *state.Defaults
	Users    identity.DB
	Logger   *slog.Logger
	Now      func() time.Time // nil: time.Now
}

// Error writes envd's REST error body {"code": status, "message": msg}.
func Error(w http.ResponseWriter, status int, msg string) {
	w.Header().Set("Content-Type", "application/json; charset=utf-8")
	w.Header().Del("Content-Encoding")
	w.Header().Del("Content-Disposition")
	w.WriteHeader(status)
	_ = json.NewEncoder(w).Encode(struct {
		Code    int    `json:"code"`
		Message string `json:"message"`
	}{status, msg})
}

type httpError struct {
	status int
	msg    string
}

func (e *httpError) Error() string { return e.msg }

func errorf(status int, format string, args ...any) error {
	return &httpError{status, fmt.Sprintf(format, args...)}
}

func writeError(w http.ResponseWriter, err error) {
	var he *httpError
	if errors.As(err, &he) {
		Error(w, he.status, he.msg)
		return
	}
	Error(w, http.StatusInternalServerError, err.Error())
}

func (h *Handler) now() time.Time {
	if h.Now != nil {
		return h.Now()
	}
	return time.Now()
}

// ServeHTTP dispatches on the method.
func (h *Handler) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	switch r.Method {
	case http.MethodGet, http.MethodHead:
		h.download(w, r)
	case http.MethodPost:
		h.upload(w, r)
	default:
		w.Header().Set("Allow", "GET, HEAD, POST")
		Error(w, http.StatusMethodNotAllowed, "method not allowed")
	}
}

// authorize accepts a valid X-Access-Token header, else a valid (unexpired) signature. With no token
// configured everything is accepted.
func (h *Handler) authorize(r *http.Request, op, path, username string) error {
	token := h.Defaults.Token()
	if token == "" {
		return nil
	}
	if got := r.Header.Get("X-Access-Token"); got != "" && h.Defaults.CheckToken(got) {
		return nil
	}
	q := r.URL.Query()
	sig := q.Get("signature")
	if sig == "" {
		return errorf(http.StatusUnauthorized, "missing or invalid access token and no signature given")
	}
	var exp *int64
	if s := q.Get("signature_expiration"); s != "" {
		n, err := strconv.ParseInt(s, 10, 64)
		if err != nil {
			return errorf(http.StatusUnauthorized, "invalid signature expiration")
		}
		if h.now().Unix() > n {
			return errorf(http.StatusUnauthorized, "signature is already expired")
		}
		exp = &n
	}
	if !verify(sig, path, op, username, token, exp) {
		return errorf(http.StatusUnauthorized, "invalid signature")
	}
	return nil
}

// user resolves ?username=, else the Basic auth user, else the sandbox default.
func (h *Handler) user(r *http.Request) (*identity.User, state.Snapshot, error) {
	snap := h.Defaults.Snapshot()
	name := r.URL.Query().Get("username")
	if name == "" {
		if n, ok := identity.BasicUser(r.Header.Get("Authorization")); ok {
			name = n
		} else {
			name = snap.User
		}
	}
	u, err := h.Users.Lookup(name)
	if err != nil {
		return nil, snap, errorf(http.StatusUnauthorized, "invalid username: '%s'", name)
	}
	return u, snap, nil
}

// negotiateGzip decides the response encoding from Accept-Encoding. A client that asks for gzip
// alone gets gzip; one that lists several codings (undici's default "gzip, deflate") gets the
// identity encoding (as E2B's envd answers); identity;q=0 forces gzip or 406.
func negotiateGzip(header string) (useGzip, ok bool) {
	if strings.TrimSpace(header) == "" {
		return false, true
	}
	gzipQ, identityQ, starQ := -1.0, -1.0, -1.0
	others := 0
	for _, item := range strings.Split(header, ",") {
		coding, params, _ := strings.Cut(strings.TrimSpace(item), ";")
		coding = strings.ToLower(strings.TrimSpace(coding))
		q := 1.0
		if params != "" {
			if k, v, found := strings.Cut(strings.TrimSpace(params), "="); found && strings.TrimSpace(k) == "q" {
				if f, err := strconv.ParseFloat(strings.TrimSpace(v), 64); err == nil {
					q = f
				}
			}
		}
		switch coding {
		case "gzip", "x-gzip":
			gzipQ = q
		case "identity":
			identityQ = q
		case "*":
			starQ = q
		case "":
		default:
			if q > 0 {
				others++
			}
		}
	}
	if identityQ < 0 {
		identityQ = 1
		if starQ == 0 {
			identityQ = 0
		}
	}
	if gzipQ < 0 && starQ > 0 {
		gzipQ = starQ
	}
	if identityQ == 0 {
		return gzipQ > 0, gzipQ > 0
	}
	return gzipQ > 0 && others == 0 && starQ < 0, true
}

func (h *Handler) download(w http.ResponseWriter, r *http.Request) {
	u, snap, err := h.user(r)
	q := r.URL.Query()
	reqPath := q.Get("path")
	if authErr := h.authorize(r, OpRead, reqPath, q.Get("username")); authErr != nil {
		writeError(w, authErr)
		return
	}
	if err != nil {
		writeError(w, err)
		return
	}
	p := identity.Resolve(reqPath, u, snap.Workdir)
	fi, err := os.Stat(p)
	if err != nil {
		switch {
		case errors.Is(err, fs.ErrNotExist):
			Error(w, http.StatusNotFound, fmt.Sprintf("path '%s' does not exist", p))
		case errors.Is(err, syscall.ENOTDIR):
			Error(w, http.StatusBadRequest, fmt.Sprintf("path '%s' is invalid: a component is not a directory", p))
		default:
			Error(w, http.StatusInternalServerError, fmt.Sprintf("error checking path '%s': %v", p, err))
		}
		return
	}
	if fi.IsDir() {
		Error(w, http.StatusBadRequest, fmt.Sprintf("path '%s' is a directory", p))
		return
	}
	if !fi.Mode().IsRegular() {
		Error(w, http.StatusBadRequest, fmt.Sprintf("path '%s' is not a regular file", p))
		return
	}
	useGzip, ok := negotiateGzip(r.Header.Get("Accept-Encoding"))
	if !ok {
		Error(w, http.StatusNotAcceptable, "no acceptable content encoding (supported: identity, gzip)")
		return
	}
	f, err := os.Open(p)
	if err != nil {
		if errors.Is(err, fs.ErrPermission) {
			Error(w, http.StatusForbidden, fmt.Sprintf("permission denied: %s", p))
			return
		}
		Error(w, http.StatusInternalServerError, fmt.Sprintf("error opening '%s': %v", p, err))
		return
	}
	defer f.Close()
	name := filepath.Base(p)
	w.Header().Set("Content-Disposition", mime.FormatMediaType("inline", map[string]string{"filename": name}))
	w.Header().Add("Vary", "Accept-Encoding")
	if !useGzip {
		http.ServeContent(w, r, name, fi.ModTime(), f)
		return
	}
	ct := mime.TypeByExtension(filepath.Ext(name))
	if ct == "" {
		ct = "application/octet-stream"
	}
	w.Header().Set("Content-Type", ct)
	w.Header().Set("Content-Encoding", "gzip")
	w.Header().Set("Last-Modified", fi.ModTime().UTC().Format(http.TimeFormat))
	w.WriteHeader(http.StatusOK)
	if r.Method == http.MethodHead {
		return
	}
	zw, _ := gzip.NewWriterLevel(w, gzip.BestSpeed)
	buf := make([]byte, 256*1024)
	if _, err := io.CopyBuffer(zw, onlyReader{f}, buf); err == nil {
		_ = zw.Close()
	}
}

// onlyReader hides WriterTo/ReaderFrom so io.CopyBuffer uses the given buffer.
type onlyReader struct{ io.Reader }

type onlyWriter struct{ io.Writer }

// WrittenFile is one element of the upload response.
type WrittenFile struct {
	Path     string            `json:"path"`
	Name     string            `json:"name"`
	Type     string            `json:"type"`
	Metadata map[string]string `json:"metadata,omitempty"`
}

// metadataHeaders collects X-Metadata-<key>: <value> headers (keys lower-cased).
func metadataHeaders(h http.Header) (map[string]string, error) {
	var md map[string]string
	for k, vs := range h {
		const prefix = "X-Metadata-"
		if len(k) < len(prefix) || !strings.EqualFold(k[:len(prefix)], prefix) {
			continue
		}
		key := strings.ToLower(k[len(prefix):])
		if !filesystem.ValidMetadataKey(key) {
			return nil, errorf(http.StatusBadRequest, "invalid metadata key %q", key)
		}
		if len(vs) != 1 || !filesystem.ValidMetadataValue(vs[0]) {
			return nil, errorf(http.StatusBadRequest, "invalid metadata value for key %q: one printable ASCII value expected", key)
		}
		if md == nil {
			md = map[string]string{}
		}
		md[key] = vs[0]
	}
	return md, nil
}

func (h *Handler) upload(w http.ResponseWriter, r *http.Request) {
	u, snap, uerr := h.user(r)
	q := r.URL.Query()
	reqPath := q.Get("path")
	if err := h.authorize(r, OpWrite, reqPath, q.Get("username")); err != nil {
		writeError(w, err)
		return
	}
	if uerr != nil {
		writeError(w, uerr)
		return
	}
	var body io.Reader = r.Body
	switch enc := strings.ToLower(strings.TrimSpace(r.Header.Get("Content-Encoding"))); enc {
	case "", "identity":
	case "gzip", "x-gzip":
		zr, err := gzip.NewReader(r.Body)
		if err != nil {
			Error(w, http.StatusBadRequest, "invalid gzip body: "+err.Error())
			return
		}
		defer zr.Close()
		body = zr
	default:
		Error(w, http.StatusBadRequest, fmt.Sprintf("unsupported content encoding '%s' (supported: gzip)", enc))
		return
	}

	mt, params, err := mime.ParseMediaType(r.Header.Get("Content-Type"))
	if err != nil && r.Header.Get("Content-Type") != "" {
		Error(w, http.StatusBadRequest, "invalid content type: "+err.Error())
		return
	}
	md, err := metadataHeaders(r.Header)
	if err != nil {
		writeError(w, err)
		return
	}
	up := uploader{user: u, workdir: snap.Workdir, seen: map[string]bool{}, buf: make([]byte, 1<<20), metadata: md}
	switch mt {
	case "multipart/form-data":
		if params["boundary"] == "" {
			Error(w, http.StatusBadRequest, "multipart body without boundary")
			return
		}
		// multipart.NewReader keeps a *bufio.Reader that is large enough instead of adding its own
		// 4 KiB one; a big buffer roughly doubles upload throughput.
		err = up.multipart(multipart.NewReader(bufio.NewReaderSize(body, 1<<20), params["boundary"]), reqPath)
	case "application/octet-stream", "":
		if reqPath == "" {
			Error(w, http.StatusBadRequest, "the path query parameter is required for an octet-stream upload")
			return
		}
		err = up.write(reqPath, body)
	default:
		Error(w, http.StatusBadRequest, fmt.Sprintf("unsupported content type '%s' (use multipart/form-data or application/octet-stream)", mt))
		return
	}
	if err != nil {
		writeError(w, err)
		return
	}
	if len(up.written) == 0 {
		Error(w, http.StatusBadRequest, "no file in the request (multipart parts must be named 'file')")
		return
	}
	w.Header().Set("Content-Type", "application/json; charset=utf-8")
	_ = json.NewEncoder(w).Encode(up.written)
}

type uploader struct {
	user     *identity.User
	workdir  string
	seen     map[string]bool
	written  []WrittenFile
	buf      []byte
	metadata map[string]string
}

// multipart writes every part named "file"; with a path query parameter the part goes there,
// otherwise to its file name (which may carry directories).
func (up *uploader) multipart(mr *multipart.Reader, reqPath string) error {
	for {
		part, err := mr.NextRawPart()
		if err == io.EOF {
			return nil
		}
		if err != nil {
			return errorf(http.StatusBadRequest, "invalid multipart body: %v", err)
		}
		name, filename := partNames(part.Header.Get("Content-Disposition"))
		if name != "file" {
			part.Close()
			continue
		}
		target := reqPath
		if target == "" {
			target = filename
		}
		if target == "" {
			part.Close()
			return errorf(http.StatusBadRequest, "a file part has no file name and no path was given")
		}
		err = up.write(target, part)
		part.Close()
		if err != nil {
			return err
		}
	}
}

// write stores r at the resolved target, creating parents owned by the user and truncating an
// existing file.
func (up *uploader) write(target string, r io.Reader) error {
	p := identity.Resolve(target, up.user, up.workdir)
	if up.seen[p] {
		return errorf(http.StatusBadRequest, "path '%s' appears more than once in the request", p)
	}
	up.seen[p] = true
	if fi, err := os.Stat(p); err == nil && fi.IsDir() {
		return errorf(http.StatusBadRequest, "path '%s' is a directory", p)
	}
	uid, gid := int(up.user.UID), int(up.user.GID)
	if err := filesystem.MkdirAllOwned(filepath.Dir(p), uid, gid); err != nil {
		return ioError(err, p)
	}
	f, err := os.OpenFile(p, os.O_WRONLY|os.O_CREATE|os.O_TRUNC, 0o644)
	if err != nil {
		return ioError(err, p)
	}
	if os.Geteuid() == 0 {
		_ = f.Chown(uid, gid)
	}
	if err := filesystem.WriteMetadata(f, up.metadata); err != nil {
		f.Close()
		if errors.Is(err, filesystem.ErrMetadataUnsupported) {
			return errorf(http.StatusBadRequest, "%v", err)
		}
		return errorf(http.StatusInternalServerError, "%v", err)
	}
	src := &readErrs{r: r}
	_, err = io.CopyBuffer(onlyWriter{f}, src, up.buf)
	if cerr := f.Close(); err == nil {
		err = cerr
	}
	if src.err != nil {
		return errorf(http.StatusBadRequest, "error reading the request body for '%s': %v", p, src.err)
	}
	if err != nil {
		return ioError(err, p)
	}
	up.written = append(up.written, WrittenFile{Path: p, Name: filepath.Base(p), Type: "file", Metadata: filesystem.ReadMetadata(p)})
	return nil
}

func ioError(err error, p string) error {
	switch {
	case errors.Is(err, syscall.ENOSPC), errors.Is(err, syscall.EDQUOT):
		return errorf(http.StatusInsufficientStorage, "not enough disk space to write '%s'", p)
	case errors.Is(err, syscall.ENOTDIR):
		return errorf(http.StatusBadRequest, "path '%s' is invalid: a parent is not a directory", p)
	case errors.Is(err, syscall.EISDIR):
		return errorf(http.StatusBadRequest, "path '%s' is a directory", p)
	case errors.Is(err, fs.ErrPermission):
		return errorf(http.StatusForbidden, "permission denied: %s", p)
	case errors.Is(err, gzip.ErrChecksum), errors.Is(err, gzip.ErrHeader), errors.Is(err, io.ErrUnexpectedEOF):
		return errorf(http.StatusBadRequest, "invalid request body for '%s': %v", p, err)
	default:
		return errorf(http.StatusInternalServerError, "error writing '%s': %v", p, err)
	}
}

// readErrs remembers whether a copy failed on the reading side (a bad or truncated request body).
type readErrs struct {
	r   io.Reader
	err error
}

func (e *readErrs) Read(b []byte) (int, error) {
	n, err := e.r.Read(b)
	if err != nil && err != io.EOF {
		e.err = err
	}
	return n, err
}
