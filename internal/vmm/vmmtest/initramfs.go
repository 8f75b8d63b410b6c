package vmmtest

import (
	"bytes"
	"fmt"
	"os"
	"path"
	"sort"
	"strings"
)

// Busybox is the host's static busybox, copied into test initramfs images.
const Busybox = "/bin/busybox"

// InitHeader is the start of every test /init: mounts, busybox applets, the virtio
// modules, loopback and (when present) the first NIC with QEMU user networking's
// addresses.
const InitHeader = `#!/bin/busybox sh
/bin/busybox mount -t proc proc /proc
/bin/busybox mount -t sysfs sys /sys
/bin/busybox mount -t devtmpfs dev /dev
/bin/busybox --install -s /bin
for m in ` + "virtio_ring virtio virtio_mmio virtio_blk failover net_failover virtio_net" + `; do
  insmod /lib/modules/$m.ko
done
ip link set lo up
if ip link set eth0 up 2>/dev/null; then
  ip addr add 10.0.2.15/24 dev eth0
  ip route add default via 10.0.2.2
fi
`

// Initramfs builds a newc cpio archive with busybox, the kernel's test modules, the
// given /init script and extra files (archive path → content; paths under cgi-bin or
// ending in .sh are executable).
func Initramfs(k Kernel, init string, files map[string]string) ([]byte, error) {
	bb, err := os.ReadFile(Busybox)
	if err != nil {
		return nil, fmt.Errorf("busybox for the test initramfs: %w", err)
	}
	var w cpioWriter
	for _, d := range []string{"bin", "dev", "proc", "sys", "mnt", "tmp", "lib", "lib/modules", "www", "www/cgi-bin"} {
		w.add(d, 0o040755, nil)
	}
	w.add("bin/busybox", 0o100755, bb)
	w.add("init", 0o100755, []byte(init))
	for _, m := range Modules {
		b, err := os.ReadFile(k.Module(m))
		if err != nil {
			return nil, fmt.Errorf("module for the test initramfs: %w", err)
		}
		w.add("lib/modules/"+m+".ko", 0o100644, b)
	}
	names := make([]string, 0, len(files))
	for n := range files {
		names = append(names, n)
	}
	sort.Strings(names)
	for _, n := range names {
		mode := uint32(0o100644)
		if strings.Contains(n, "cgi-bin/") || path.Ext(n) == ".sh" {
			mode = 0o100755
		}
		w.add(strings.TrimPrefix(n, "/"), mode, []byte(files[n]))
	}
	w.add("TRAILER!!!", 0, nil)
	return w.buf.Bytes(), nil
}

// cpioWriter writes the "newc" format the kernel unpacks into its initial rootfs.
type cpioWriter struct {
	buf bytes.Buffer
	ino uint32
}

func (w *cpioWriter) add(name string, mode uint32, data []byte) {
	w.ino++
	nlink := 1
	if mode&0o040000 != 0 {
		nlink = 2
	}
	fmt.Fprintf(&w.buf, "070701%08X%08X%08X%08X%08X%08X%08X%08X%08X%08X%08X%08X%08X",
		w.ino, mode, 0, 0, nlink, 0, len(data), 0, 0, 0, 0, len(name)+1, 0)
	w.buf.WriteString(name)
	w.buf.WriteByte(0)
	w.pad()
	w.buf.Write(data)
	w.pad()
}

func (w *cpioWriter) pad() {
	for w.buf.Len()%4 != 0 {
		w.buf.WriteByte(0)
	}
}
