#!/usr/bin/env bash
# Installs the system packages aenv needs to build and serve (and, with --test, to test),
# when they are missing.
# Idempotent; safe to run on every `make serve` / `make test`.
set -euo pipefail

# --test adds what only `make test` needs: a C compiler and libc's headers, for the race
# detector (cgo).
extra=()
if [ "${1:-}" = "--test" ]; then
  extra=(gcc libc6-dev)
fi

need=()
have() { dpkg-query -W -f='${Status}' "$1" 2>/dev/null | grep -q "install ok installed"; }
for pkg in crun runc e2fsprogs iproute2 nftables iptables busybox-static bash-static fuse3 protobuf-compiler libprotobuf-dev ca-certificates \
    qemu-system-x86 lz4 debootstrap util-linux git openssl "${extra[@]}"; do
  have "$pkg" || need+=("$pkg")
done
command -v node >/dev/null 2>&1 || need+=(nodejs npm)

if [ ${#need[@]} -gt 0 ]; then
  if [ "$(id -u)" -ne 0 ]; then
    echo "missing packages: ${need[*]}; run as root or install them with apt-get" >&2
    exit 1
  fi
  echo "installing: ${need[*]}"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
fi
