#!/usr/bin/env bash
# Checks that a fresh Debian machine gets what the build needs from scripts/deps.sh: in a
# throwaway copy of a minimal Debian root (debootstrap --variant=minbase, cached by
# scripts/debian-root.sh) it runs scripts/deps.sh --test, then `go build ./...`, a build with
# the race detector (cgo) and the generated-code check. It catches a package deps.sh forgets
# (libprotobuf-dev was one) that a developer's machine happens to have.
#
# Everything it mounts lives in a private mount and PID namespace of its own, so the kernel
# removes every mount, and every process started in the root, when the script ends, however
# it ends (kill -9 included). Apt's downloads and Go's caches are kept between runs
# (Go's as a writable layer over the host's, which stay untouched), so a rerun takes about a
# minute; the first one downloads deps.sh's packages.
set -euo pipefail

repo=$(cd "$(dirname "$0")/.." && pwd)
cache=${AENV_TEST_CACHE:-/var/cache/aenv-test}

if [ "${1:-}" != "--inside" ]; then
  [ "$(id -u)" -eq 0 ] || { echo "fresh-check: needs root (chroot, mounts)" >&2; exit 1; }
  command -v unshare >/dev/null || { echo "fresh-check: unshare missing (util-linux)" >&2; exit 1; }
  base=$("$repo/scripts/debian-root.sh")
  mkdir -p "$cache"
  # Work directories of runs that were killed (their pid is gone).
  for d in "$cache"/fresh-work.*; do
    [ -d "$d" ] || continue
    pid=${d##*.}
    kill -0 "$pid" 2>/dev/null || rm -rf --one-file-system "$d"
  done
  work="$cache/fresh-work.$$"
  mkdir -p "$work"
  trap 'rm -rf --one-file-system "$work"' EXIT
  # --kill-child: were this script killed, unshare's child (and with it the PID namespace,
  # its processes and its mounts) goes too.
  unshare --mount --propagation private --pid --fork --kill-child \
    "$0" --inside "$base" "$work"
  exit $?
fi

base=$2
work=$3
root="$work/root"
mkdir -p "$root" "$work/upper" "$work/ovl" "$cache/fresh-apt/archives/partial" "$cache/fresh-apt/lists/partial"
mount -t overlay overlay -o "lowerdir=$base,upperdir=$work/upper,workdir=$work/ovl" "$root"

# Apt reaches Debian's mirror as the host's apt does: its sources and Acquire settings.
rm -rf "$root/etc/apt/sources.list.d" "$root/etc/apt/sources.list"
cp -a /etc/apt/sources.list.d "$root/etc/apt/" 2>/dev/null || mkdir -p "$root/etc/apt/sources.list.d"
[ -e /etc/apt/sources.list ] && cp -a /etc/apt/sources.list "$root/etc/apt/"
find "$root/etc/apt/sources.list.d" -type f ! -name '*.list' ! -name '*.sources' -delete
apt-config dump | grep '^Acquire::' >"$root/etc/apt/apt.conf.d/90host-acquire" || true
cp -L /etc/resolv.conf "$root/etc/resolv.conf"
# A throwaway root: dpkg need not fsync every file it unpacks.
echo force-unsafe-io >"$root/etc/dpkg/dpkg.cfg.d/aenv-unsafe-io"

mount -t proc proc "$root/proc"
mount --rbind /dev "$root/dev"
mount -t tmpfs tmpfs "$root/tmp"
mount --bind "$cache/fresh-apt/archives" "$root/var/cache/apt/archives"
mount --bind "$cache/fresh-apt/lists" "$root/var/lib/apt/lists"

# Go from the host, read-only; its module and build caches as lower layers under writable ones.
goroot=$(go env GOROOT)
mkdir -p "$root/usr/local/go"
mount --bind -o ro "$goroot" "$root/usr/local/go"
mount -o remount,bind,ro "$root/usr/local/go"
for c in GOMODCACHE GOCACHE; do
  host=$(go env "$c")
  mkdir -p "$host" "$cache/fresh-go/$c" "$work/go-$c-ovl" "$root/go/$c"
  mount -t overlay overlay -o "lowerdir=$host,upperdir=$cache/fresh-go/$c,workdir=$work/go-$c-ovl" "$root/go/$c"
done

# The checkout as it is (tracked and untracked, not ignored files), never the host's tree.
mkdir -p "$root/src"
git -C "$repo" ls-files -z --cached --others --exclude-standard |
  (cd "$repo" && tar --null --no-recursion --ignore-failed-read -T - -cf - 2>/dev/null) | tar -x -C "$root/src"

echo "fresh-check: scripts/deps.sh in a fresh Debian root"
chroot "$root" /usr/bin/env -i HOME=/root PATH=/usr/local/go/bin:/usr/sbin:/usr/bin:/sbin:/bin \
  GOMODCACHE=/go/GOMODCACHE GOCACHE=/go/GOCACHE GOTOOLCHAIN=local CGO_ENABLED=0 \
  /bin/bash -euo pipefail -c '
    cd /src
    scripts/deps.sh --test
    echo "fresh-check: go build ./..."
    go build ./...
    echo "fresh-check: a race-detector build (cgo)"
    CGO_ENABLED=1 go test -race -c -o /dev/null ./internal/relay
    echo "fresh-check: generated code"
    scripts/check-generated.sh
  '
echo "fresh-check: a fresh machine builds and regenerates the code"
