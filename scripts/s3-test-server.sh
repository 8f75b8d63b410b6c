#!/usr/bin/env bash
# The real S3 server the repository tests run against: versitygw (Apache-2.0)
# with its posix backend, built from the Go module proxy.
#
#   scripts/s3-test-server.sh install         install versitygw into $(go env GOPATH)/bin if missing
#   scripts/s3-test-server.sh start DIR [ADDR] run it in the foreground on ADDR (default 127.0.0.1:7070),
#                                              storing buckets under DIR, with the test keys
#
# Tests start their own server on a free loopback port (internal/repository/s3/s3test) and find the
# binary through $AENV_VERSITYGW, PATH or $(go env GOPATH)/bin; they skip, saying so, when it is missing.
set -euo pipefail

VERSION=v1.8.0
GO=${GO:-go}

bin() {
  if [ -n "${AENV_VERSITYGW:-}" ]; then echo "$AENV_VERSITYGW"; return; fi
  if command -v versitygw >/dev/null 2>&1; then command -v versitygw; return; fi
  local gobin
  gobin=$($GO env GOBIN)
  [ -n "$gobin" ] || gobin="$($GO env GOPATH)/bin"
  echo "$gobin/versitygw"
}

case "${1:-}" in
install)
  b=$(bin)
  if [ -x "$b" ] && $GO version -m "$b" 2>/dev/null | grep -Eq "^\s+mod\s+github.com/versity/versitygw\s+$VERSION\b"; then
    exit 0
  fi
  echo "installing versitygw $VERSION (builds from the Go module proxy; a few minutes on 2 cores)"
  CGO_ENABLED=0 $GO install "github.com/versity/versitygw/cmd/versitygw@$VERSION"
  ;;
start)
  dir=${2:?usage: $0 start DIR [ADDR]}
  addr=${3:-127.0.0.1:7070}
  mkdir -p "$dir"
  exec "$(bin)" --access aenv-test-access --secret aenv-test-secret-key --port "$addr" --quiet \
    --virtual-domain localhost posix "$dir"
  ;;
*)
  echo "usage: $0 install | start DIR [ADDR]" >&2
  exit 2
  ;;
esac
