#!/usr/bin/env bash
# Builds the microvm backend's guest: an uncompressed PVH vmlinux from Debian's
# linux-image-cloud-amd64 and an initramfs (busybox-static, the virtio modules, /init).
# Nothing is installed into /boot or /lib/modules: the packages are fetched with
# `apt-get download` and unpacked with `dpkg -x` into a cache directory.
#
# Usage: scripts/microvm-guest.sh [OUT_DIR]   (default bin/microvm)
# Writes OUT_DIR/vmlinux, OUT_DIR/initrd.img and OUT_DIR/kernel-version; does nothing when
# they exist and are newer than this script and microvm-init.sh. envd is not in the initramfs: the backend
# appends it as a second cpio archive at start, so a rebuilt envd needs no new guest.
set -euo pipefail

here=$(cd "$(dirname "$0")" && pwd)
out=${1:-bin/microvm}
cache=${AENV_GUEST_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/aenv/microvm-guest}
busybox=${BUSYBOX:-/bin/busybox}

if [ -s "$out/vmlinux" ] && [ -s "$out/initrd.img" ] && [ -s "$out/kernel-version" ] &&
  [ "$out/initrd.img" -nt "$here/microvm-guest.sh" ] && [ "$out/initrd.img" -nt "$here/microvm-init.sh" ]; then
  exit 0
fi
for tool in apt-get apt-cache dpkg-deb lz4; do
  command -v "$tool" >/dev/null || { echo "microvm-guest: $tool is missing (scripts/deps.sh installs it)" >&2; exit 1; }
done
[ -x "$busybox" ] || { echo "microvm-guest: static busybox $busybox is missing (busybox-static)" >&2; exit 1; }

mkdir -p "$cache/debs" "$out"
# The meta package names the versioned image package (linux-image-<abi>-cloud-amd64).
image=$(apt-cache depends linux-image-cloud-amd64 2>/dev/null | awk '/Depends: linux-image-/{print $2; exit}')
[ -n "$image" ] || { echo "microvm-guest: apt knows no linux-image-cloud-amd64 (run apt-get update)" >&2; exit 1; }
if ! ls "$cache/debs/${image}_"*.deb >/dev/null 2>&1; then
  (cd "$cache/debs" && apt-get download -qq -o APT::Sandbox::User=root "$image")
fi
deb=$(ls "$cache/debs/${image}_"*.deb | sort | tail -1)

work=$(mktemp -d "$cache/work.XXXXXX")
trap 'rm -rf "$work"' EXIT
dpkg-deb -x "$deb" "$work/pkg"
vmlinuz=$(ls "$work"/pkg/boot/vmlinuz-* | head -1)
kver=${vmlinuz##*/vmlinuz-}
mods="$work/pkg/lib/modules/$kver/kernel"

# The bzImage payload is one LZ4 legacy frame: cut at its magic and decompress. The result
# is an ELF with a PVH entry note, which QEMU boots directly (no decompression in the guest).
off=$(grep -obUaP '\x02\x21\x4c\x18' "$vmlinuz" | head -1 | cut -d: -f1)
[ -n "$off" ] || { echo "microvm-guest: no LZ4 payload in $vmlinuz" >&2; exit 1; }
tail -c +$((off + 1)) "$vmlinuz" | lz4 -dc >"$work/vmlinux" 2>/dev/null || true
[ "$(head -c 4 "$work/vmlinux" | od -An -c | tr -d ' ')" = '177ELF' ] ||
  { echo "microvm-guest: $vmlinuz did not give an ELF vmlinux" >&2; exit 1; }

# initramfs: busybox, the modules in load order (no modules.dep in the package), /init.
root="$work/initrd"
mkdir -p "$root"/{bin,dev,proc,sys,newroot,lib/modules,etc}
cp "$busybox" "$root/bin/busybox"
order=(
  drivers/virtio/virtio_ring drivers/virtio/virtio drivers/virtio/virtio_mmio
  drivers/block/virtio_blk net/core/failover drivers/net/net_failover drivers/net/virtio_net
  drivers/char/hw_random/virtio-rng
)
: >"$root/lib/modules/order"
for m in "${order[@]}"; do
  f=$(ls "$mods/$m.ko"* 2>/dev/null | head -1)
  [ -n "$f" ] || { echo "microvm-guest: module $m missing from $image" >&2; exit 1; }
  case "$f" in
  *.ko.xz) xz -dc "$f" >"$root/lib/modules/${m##*/}.ko" ;;
  *.ko.zst) zstd -qdc "$f" >"$root/lib/modules/${m##*/}.ko" ;;
  *) cp "$f" "$root/lib/modules/${m##*/}.ko" ;;
  esac
  echo "${m##*/}" >>"$root/lib/modules/order"
done
install -m 0755 "$here/microvm-init.sh" "$root/init"
(cd "$root" && find . | LC_ALL=C sort | "$busybox" cpio -o -H newc 2>/dev/null) >"$work/initrd.img"

mv "$work/vmlinux" "$out/vmlinux.tmp" && mv "$out/vmlinux.tmp" "$out/vmlinux"
echo "$kver" >"$out/kernel-version"
mv "$work/initrd.img" "$out/initrd.img.tmp" && mv "$out/initrd.img.tmp" "$out/initrd.img"
echo "microvm guest: kernel $kver, $(du -h "$out/initrd.img" | cut -f1) initramfs in $out"
