package server

import (
	"crypto/sha256"
	"crypto/subtle"
	"encoding/base64"
	"net/http"
	"strconv"
	"time"

	"github.com/aenv-dev/aenv/internal/orchestrator"
)

// FileSignature computes E2B's /files URL signature (envd and SDK algorithm):
// "v1_" + unpadded base64(sha256("<path>:<operation>:<username>:<token>[:<expiration>]")).
// operation is "read" or "write"; expiration is unix seconds, or 0 for a URL that does not
// expire.
func FileSignature(path, operation, username, token string, expiration int64) string {
	raw := path + ":" + operation + ":" + username + ":" + token
	if expiration != 0 {
		raw += ":" + strconv.FormatInt(expiration, 10)
	}
	sum := sha256.Sum256([]byte(raw))
	return "v1_" + base64.RawStdEncoding.EncodeToString(sum[:])
}

// bySignature routes a signed /files URL (from the SDK's uploadUrl()/downloadUrl()), which
// names no sandbox: it goes to the sandbox whose envd token reproduces the signature.
// envd verifies the signature again before serving the file.
func (p *sandboxProxy) bySignature(w http.ResponseWriter, r *http.Request) {
	q := r.URL.Query()
	var op string
	switch r.Method {
	case http.MethodGet, http.MethodHead:
		op = "read"
	case http.MethodPost:
		op = "write"
	default:
		writeError(w, http.StatusMethodNotAllowed, "signed /files URLs accept GET and POST, not %s", r.Method)
		return
	}
	var exp int64
	if s := q.Get("signature_expiration"); s != "" {
		n, err := strconv.ParseInt(s, 10, 64)
		if err != nil {
			writeError(w, http.StatusBadRequest, "signature_expiration must be unix seconds, got %q", s)
			return
		}
		if time.Now().Unix() > n {
			// envd's wording, which the SDK's tests match: the node answers in its place.
			writeError(w, http.StatusUnauthorized, "signature is already expired")
			return
		}
		exp = n
	}
	sig := q.Get("signature")
	path, user := q.Get("path"), q.Get("username")
	all, err := listAll(r.Context(), p.orch, orchestrator.ListFilter{})
	if err != nil {
		writeOrchError(w, r, err)
		return
	}
	for _, sb := range all {
		if sb.EnvdAccessToken == "" {
			continue
		}
		want := FileSignature(path, op, user, sb.EnvdAccessToken, exp)
		if subtle.ConstantTimeCompare([]byte(want), []byte(sig)) == 1 {
			p.forward(w, r, target{id: sb.ID, port: EnvdPort, path: r.URL.Path, rawPath: r.URL.RawPath})
			return
		}
	}
	writeError(w, http.StatusUnauthorized, "the URL signature does not match any sandbox")
}
