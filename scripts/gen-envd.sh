#!/usr/bin/env bash
# Generates the envd Go code (protobuf messages + connect-go handlers) from api/proto/{process,filesystem}.
# Reproducible: protoc from Debian's protobuf-compiler, plugins built from the versions pinned in go.mod
# (`tool` directives), paths relative to api/proto. Output lives next to its package under internal/envd/gen.
set -euo pipefail
cd "$(dirname "$0")/.."

command -v protoc >/dev/null || { echo "gen-envd: protoc missing (apt-get install protobuf-compiler)" >&2; exit 1; }
inc=/usr/include
[ -f "$inc/google/protobuf/timestamp.proto" ] || { echo "gen-envd: $inc/google/protobuf/timestamp.proto missing" >&2; exit 1; }

tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
go build -o "$tmp/protoc-gen-go" google.golang.org/protobuf/cmd/protoc-gen-go
go build -o "$tmp/protoc-gen-connect-go" connectrpc.com/connect/cmd/protoc-gen-connect-go

out=internal/envd/gen
rm -rf "$out"
mkdir -p "$out"
protoc \
  --plugin=protoc-gen-go="$tmp/protoc-gen-go" \
  --plugin=protoc-gen-connect-go="$tmp/protoc-gen-connect-go" \
  -I api/proto -I "$inc" \
  --go_out=. --go_opt=module=github.com/aenv-dev/aenv \
  --connect-go_out=. --connect-go_opt=module=github.com/aenv-dev/aenv \
  process/process.proto filesystem/filesystem.proto
gofmt -l "$out" | (! grep .) || { echo "gen-envd: generated code is not gofmt-clean" >&2; exit 1; }
