#!/usr/bin/env bash
# Generates the control-plane server interface, types and client from api/openapi.yaml with the
# oapi-codegen version pinned in go.mod, so the output is reproducible.
set -euo pipefail
cd "$(dirname "$0")/.."
out=internal/server/api/api.gen.go
go tool oapi-codegen -config internal/server/api/oapi-codegen.yaml api/openapi.yaml
# The module requires Go >= 1.26, so the go1.22 build tag and the generator's package comment
# (doc.go has ours) are dropped: the file starts with its "Code generated" marker.
sed -i '1,/^\/\/ Code generated/{/^\/\/ Code generated/!d}' "$out"
gofmt -w "$out"
