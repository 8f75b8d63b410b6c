#!/usr/bin/env bash
# Prints the path of a minimal Debian root (debootstrap --variant=minbase), built once per
# machine and cached: what public images look like (usr-merged glibc, no `user` account).
# Tests build OCI images from it; scripts/fresh-check.sh runs scripts/deps.sh inside a copy.
# The cache key holds the suite and a version: bump AENV_DEBIAN_ROOT_VERSION's default when
# what is built here changes. Callers must not write into the printed root.
set -euo pipefail

suite=${AENV_DEBIAN_SUITE:-bookworm}
version=${AENV_DEBIAN_ROOT_VERSION:-1}
cache=${AENV_TEST_CACHE:-/var/cache/aenv-test}
dir="$cache/debian-$suite-minbase-v$version"

if [ -e "$dir/.complete" ]; then
  echo "$dir/root"
  exit 0
fi
if [ "$(id -u)" -ne 0 ]; then
  echo "debian-root: building $dir needs root" >&2
  exit 1
fi
command -v debootstrap >/dev/null || { echo "debian-root: debootstrap missing (scripts/deps.sh installs it)" >&2; exit 1; }
mkdir -p "$cache"
# One builder per machine; the others wait and reuse its result.
exec 9>"$cache/.debian-$suite.lock"
flock 9
if [ -e "$dir/.complete" ]; then
  echo "$dir/root"
  exit 0
fi

# The mirror the host's apt uses (deb822 or one-line sources), else Debian's CDN.
mirror=$(sed -n 's/^URIs:[[:space:]]*\([^[:space:]]*\/debian\)[[:space:]]*$/\1/p' /etc/apt/sources.list.d/*.sources 2>/dev/null | head -1 || true)
if [ -z "$mirror" ]; then
  mirror=$(awk '$1=="deb" && $2 !~ /^\[/ && $2 ~ /\/debian\/?$/ {print $2; exit}' /etc/apt/sources.list /etc/apt/sources.list.d/*.list 2>/dev/null || true)
fi
mirror=${AENV_DEBIAN_MIRROR:-${mirror:-http://deb.debian.org/debian}}

tmp=$(mktemp -d "$cache/.debian-$suite.XXXXXX")
cleanup() {
  # debootstrap mounts /proc and /sys inside its target; a killed run must leak neither.
  { findmnt -rn -o TARGET | grep -F "$tmp/" || true; } | sort -r | while read -r m; do umount -l "$m" || true; done
  rm -rf --one-file-system "$tmp"
}
trap cleanup EXIT
trap 'exit 1' INT TERM HUP

echo "debian-root: debootstrap --variant=minbase $suite from $mirror (about 1.5 min, once per machine)" >&2
# A mirror's hiccup fails a fresh machine's first run (seen once in CI, with nothing in
# the log): try three times, each from an empty target.
for attempt in 1 2 3; do
  if debootstrap --variant=minbase "$suite" "$tmp/root" "$mirror" >"$tmp/log" 2>&1; then
    break
  fi
  echo "debian-root: debootstrap failed (attempt $attempt of 3):" >&2
  tail -30 "$tmp/log" >&2
  [ "$attempt" -lt 3 ] || exit 1
  { findmnt -rn -o TARGET | grep -F "$tmp/" || true; } | sort -r | while read -r m; do umount -l "$m" || true; done
  rm -rf --one-file-system "$tmp/root"
  sleep 5
done
rm -rf "$tmp/root/var/cache/apt/archives/"*.deb "$tmp/root/var/lib/apt/lists/"*_* || true
touch "$tmp/.complete"
rm -rf --one-file-system "$dir"
mv "$tmp" "$dir"
echo "$dir/root"
