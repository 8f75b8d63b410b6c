#!/bin/busybox sh
# /init of the microvm guest's initramfs (scripts/microvm-guest.sh packs it). It loads the
# virtio modules, mounts the sandbox's root disk (virtio-blk, /dev/vda), configures eth0
# from the kernel command line and hands over to envd as PID 1 of the sandbox's root.
#
# Settings come from the command line (the backend writes them):
#   aenv.ip=ADDR/PREFIX aenv.gw=ADDR   eth0's address and default route (absent: no network)
#   aenv.hostname=NAME aenv.dns=A,B    hostname, nameservers (/etc/resolv.conf over a tmpfs file)
#   aenv.port=N                        envd's port (default 49983)
#   aenv.envd=PATH                     where envd is bind-mounted in the root (default /.aenv/envd)
# Markers on the console (ttyS0) let the host tell how far a boot got.
/bin/busybox mount -t proc proc /proc
/bin/busybox mount -t sysfs sys /sys
/bin/busybox mount -t devtmpfs dev /dev
/bin/busybox --install -s /bin
export PATH=/bin

fail() {
	echo "AENV-INIT-FAILED: $*"
	sync
	poweroff -f
	sleep 1000000
}

ip_cidr= gw= host=sandbox dns= port=49983 envd_at=/.aenv/envd
for kv in $(cat /proc/cmdline); do
	case "$kv" in
	aenv.ip=*) ip_cidr=${kv#*=} ;;
	aenv.gw=*) gw=${kv#*=} ;;
	aenv.hostname=*) host=${kv#*=} ;;
	aenv.dns=*) dns=${kv#*=} ;;
	aenv.port=*) port=${kv#*=} ;;
	aenv.envd=*) envd_at=${kv#*=} ;;
	esac
done

while read -r m; do
	insmod "/lib/modules/$m.ko" || fail "insmod $m"
done </lib/modules/order
echo "AENV-INIT-MODULES $(cut -d" " -f1 /proc/uptime)"

n=0
while [ ! -b /dev/vda ] && [ $n -lt 500 ]; do
	usleep 10000
	n=$((n + 1))
done
[ -b /dev/vda ] || fail "no root disk /dev/vda"
mount -t ext4 -o noatime /dev/vda /newroot || fail "mount /dev/vda"
echo "AENV-INIT-MOUNTED $(cut -d" " -f1 /proc/uptime)"

hostname "$host"
ip link set lo up
if [ -n "$ip_cidr" ]; then
	ip link set eth0 up || fail "no eth0"
	ip addr add "$ip_cidr" dev eth0 || fail "address $ip_cidr"
	[ -z "$gw" ] || ip route add default via "$gw" || fail "route via $gw"
fi

r=/newroot
for d in proc sys dev run tmp; do [ -d "$r/$d" ] || mkdir -p "$r/$d"; done
mount -t proc proc "$r/proc"
mount -t sysfs sysfs "$r/sys"
mount -t devtmpfs devtmpfs "$r/dev"
mkdir -p "$r/dev/pts" "$r/dev/shm"
mount -t devpts -o newinstance,ptmxmode=0666,mode=0620,gid=5 devpts "$r/dev/pts"
ln -sf pts/ptmx "$r/dev/ptmx" 2>/dev/null
mount -t tmpfs -o nosuid,nodev,mode=1777 shm "$r/dev/shm"
mount -t tmpfs -o nosuid,nodev,mode=755 run "$r/run"
[ -d /sys/fs/cgroup ] && mount -t cgroup2 cgroup2 "$r/sys/fs/cgroup" 2>/dev/null

# envd and the per-boot files live in the initramfs and are bind-mounted over placeholders,
# so nothing of the guest's plumbing is written into the sandbox's disk.
mkdir -p /etc/aenv
echo "$host" >/etc/aenv/hostname
printf '127.0.0.1\tlocalhost\n::1\tlocalhost ip6-localhost ip6-loopback\n127.0.1.1\t%s\n' "$host" >/etc/aenv/hosts
: >/etc/aenv/resolv.conf
for ns in $(echo "$dns" | tr ',' ' '); do echo "nameserver $ns" >>/etc/aenv/resolv.conf; done
for f in hostname hosts resolv.conf; do
	[ -e "$r/etc/$f" ] || { mkdir -p "$r/etc" && : >"$r/etc/$f"; } 2>/dev/null
	mount --bind "/etc/aenv/$f" "$r/etc/$f" 2>/dev/null
done
[ -e "$r$envd_at" ] || { mkdir -p "$r${envd_at%/*}" && : >"$r$envd_at"; } || fail "no place for envd at $envd_at"
mount --bind /envd "$r$envd_at" || fail "bind envd"
mount -o remount,bind,ro "$r$envd_at"

echo "AENV-INIT-DONE $(cut -d" " -f1 /proc/uptime)"
exec env -i PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin HOME=/root \
	E2B_SANDBOX=true AENV_ENVD_PORT="$port" \
	switch_root "$r" "$envd_at" -port "$port" -set-clock -set-hostname -idle-trim 0
