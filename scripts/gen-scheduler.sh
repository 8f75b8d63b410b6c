#!/usr/bin/env bash
# Generates the cluster scheduler's Go code (protobuf messages + grpc-go service) from
# api/proto/scheduler/v1. Reproducible: protoc from Debian's protobuf-compiler, plugins built from
# the versions pinned in go.mod (`tool` directives), paths relative to api/proto. Output lives next
# to its package under internal/cluster/scheduler/gen.
set -euo pipefail
cd "$(dirname "$0")/.."

command -v protoc >/dev/null || { echo "gen-scheduler: protoc missing (apt-get install protobuf-compiler)" >&2; exit 1; }

tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
go build -o "$tmp/protoc-gen-go" google.golang.org/protobuf/cmd/protoc-gen-go
go build -o "$tmp/protoc-gen-go-grpc" google.golang.org/grpc/cmd/protoc-gen-go-grpc

out=internal/cluster/scheduler/gen
rm -rf "$out"
mkdir -p "$out"
protoc \
  --plugin=protoc-gen-go="$tmp/protoc-gen-go" \
  --plugin=protoc-gen-go-grpc="$tmp/protoc-gen-go-grpc" \
  -I api/proto \
  --go_out=. --go_opt=module=github.com/aenv-dev/aenv \
  --go-grpc_out=. --go-grpc_opt=module=github.com/aenv-dev/aenv \
  scheduler/v1/scheduler.proto
gofmt -l "$out" | (! grep .) || { echo "gen-scheduler: generated code is not gofmt-clean" >&2; exit 1; }
