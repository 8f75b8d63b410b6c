package server

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
)

// ownerKey carries the caller's owner in a request's context.
type ownerKey struct{}

// OwnerOf is the owner of resources made with API key key (volumes, secrets): a digest
// of the key, so the same key finds them again after a restart or a catalog rebuild, and
// another key never sees them.
func OwnerOf(key string) string {
	sum := sha256.Sum256([]byte("aenv-owner\x00" + key))
	return "key_" + hex.EncodeToString(sum[:12])
}

func withOwner(ctx context.Context, owner string) context.Context {
	return context.WithValue(ctx, ownerKey{}, owner)
}

// ownerFrom is the authenticated caller's owner ("" on routes without an API key).
func ownerFrom(ctx context.Context) string {
	o, _ := ctx.Value(ownerKey{}).(string)
	return o
}
