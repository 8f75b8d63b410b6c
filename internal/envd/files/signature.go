package files

import (
	"crypto/sha256"
	"crypto/subtle"
	"encoding/base64"
	"strconv"
)

// Operations signed into /files URLs.
const (
	OpRead  = "read"
	OpWrite = "write"
)

// Sign computes E2B's v1 /files signature:
// "v1_" + base64(sha256("<path>:<op>:<user>:<token>[:<expiration>]")) without padding.
// path is the path as the caller gave it (not resolved); user is "" when none was given.
func Sign(path, op, user, token string, expiration *int64) string {
	raw := path + ":" + op + ":" + user + ":" + token
	if expiration != nil {
		raw += ":" + strconv.FormatInt(*expiration, 10)
	}
	sum := sha256.Sum256([]byte(raw))
	return "v1_" + base64.RawStdEncoding.EncodeToString(sum[:])
}

// verify reports whether sig is the signature of the other arguments (constant time).
func verify(sig, path, op, user, token string, expiration *int64) bool {
	want := Sign(path, op, user, token, expiration)
	return subtle.ConstantTimeCompare([]byte(sig), []byte(want)) == 1
}
