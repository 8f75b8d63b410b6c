// Package api holds the Go types, server interface and client generated from the
// control-plane contract api/openapi.yaml. Regenerate with scripts/gen-openapi.sh.
package api
