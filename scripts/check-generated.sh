#!/usr/bin/env bash
# Fails when generated code is stale: regenerates and compares every file marked "Code generated".
set -euo pipefail
cd "$(dirname "$0")/.."
snapshot() { grep -rl --include='*.go' '^// Code generated' . 2>/dev/null | grep -v '/node_modules/' | sort | xargs -r sha256sum; }
before=$(snapshot)
scripts/gen.sh >/dev/null
after=$(snapshot)
if [ "$before" != "$after" ]; then
  echo "generated code is stale; run 'make gen' and commit the result:" >&2
  diff <(echo "$before") <(echo "$after") >&2 || true
  exit 1
fi
echo "generated code is up to date"
