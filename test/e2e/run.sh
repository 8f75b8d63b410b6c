#!/usr/bin/env bash
# SDK end-to-end tests: the pinned e2b npm SDK against our envd and `aenv serve`.
# Each *.test.mjs starts the servers it needs from ../../bin.
set -euo pipefail
cd "$(dirname "$0")"
if [ ! -d node_modules ] || [ package-lock.json -nt node_modules ]; then
  npm ci --no-audit --no-fund --loglevel=error
fi
shopt -s nullglob
tests=(*.test.mjs)
if [ ${#tests[@]} -eq 0 ]; then echo "e2e: no tests"; exit 0; fi
node --test --test-concurrency=1 "${tests[@]}"
