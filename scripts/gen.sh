#!/usr/bin/env bash
# Runs every code generator in the repo (scripts/gen-*.sh), each reproducible from pinned tools.
set -euo pipefail
cd "$(dirname "$0")/.."
for g in scripts/gen-*.sh; do
  [ -e "$g" ] || continue
  echo "gen: $g"
  bash "$g"
done
