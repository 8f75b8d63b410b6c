package microvm

import (
	"bytes"
	"fmt"
	"net/netip"
	"os"
	"path/filepath"
	"strconv"
	"strings"
)

// buildInitrd writes base (the initramfs of scripts/microvm-guest.sh) followed by a second
// cpio archive holding envd at /envd to out. The kernel unpacks concatenated archives in
// order, so envd comes from the node (Config.EnvdPath) without rebuilding the guest.
func buildInitrd(base, envd, out string) error {
	b, err := os.ReadFile(base)
	if err != nil {
		return fmt.Errorf("microvm: initramfs: %w", err)
	}
	e, err := os.ReadFile(envd)
	if err != nil {
		return fmt.Errorf("microvm: envd: %w", err)
	}
	var buf bytes.Buffer
	buf.Write(b)
	// The kernel wants each archive to start 4-byte aligned.
	for buf.Len()%4 != 0 {
		buf.WriteByte(0)
	}
	writeNewc(&buf, "envd", 0o100755, e)
	writeNewc(&buf, "TRAILER!!!", 0, nil)
	tmp := out + ".tmp"
	if err := os.WriteFile(tmp, buf.Bytes(), 0o644); err != nil {
		return fmt.Errorf("microvm: initramfs: %w", err)
	}
	if err := os.Rename(tmp, out); err != nil {
		return fmt.Errorf("microvm: initramfs: %w", err)
	}
	return nil
}

// writeNewc appends one entry in the cpio "newc" format (what the kernel's initramfs
// unpacker reads): a 110-byte ASCII header, the NUL-terminated name and the data, each
// padded to 4 bytes.
func writeNewc(w *bytes.Buffer, name string, mode uint32, data []byte) {
	nlink := 1
	if mode == 0 {
		nlink = 0
	}
	fmt.Fprintf(w, "070701%08X%08X%08X%08X%08X%08X%08X%08X%08X%08X%08X%08X%08X",
		0, mode, 0, 0, nlink, 0, len(data), 0, 0, 0, 0, len(name)+1, 0)
	w.WriteString(name)
	w.WriteByte(0)
	for w.Len()%4 != 0 {
		w.WriteByte(0)
	}
	w.Write(data)
	for w.Len()%4 != 0 {
		w.WriteByte(0)
	}
}

// bootParams are the per-boot settings on the guest kernel's command line.
type bootParams struct {
	ip       netip.Prefix
	gateway  netip.Addr
	hostname string
	dns      []string
	envdPort int
}

// cmdline is the guest kernel command line (package vmm adds tsc_early_khz under TCG).
// The flags trim boot time (../shared/reference/microvm.md §3); panic=1 with QEMU's
// -no-reboot ends the VM when its PID 1 (envd) dies.
func (p bootParams) cmdline() string {
	a := []string{
		"console=ttyS0", "quiet", "panic=1", "no_timer_check", "tsc=reliable",
		"i8042.noaux", "i8042.nomux", "i8042.nopnp", "i8042.dumbkbd", "8250.nr_uarts=1",
		"random.trust_cpu=on", "cryptomgr.notests", "audit=0", "pci=off",
	}
	if p.ip.IsValid() {
		a = append(a, "aenv.ip="+p.ip.String())
	}
	if p.gateway.IsValid() {
		a = append(a, "aenv.gw="+p.gateway.String())
	}
	if p.hostname != "" {
		a = append(a, "aenv.hostname="+p.hostname)
	}
	if len(p.dns) > 0 {
		a = append(a, "aenv.dns="+strings.Join(p.dns, ","))
	}
	if p.envdPort > 0 {
		a = append(a, "aenv.port="+strconv.Itoa(p.envdPort))
	}
	return strings.Join(a, " ")
}

// nameservers returns the nameservers of a resolv.conf that a sandbox can reach (none on
// loopback); nil when there are none.
func nameservers(path string) []string {
	raw, err := os.ReadFile(filepath.Clean(path))
	if err != nil {
		return nil
	}
	var out []string
	for _, l := range strings.Split(string(raw), "\n") {
		f := strings.Fields(l)
		if len(f) < 2 || f[0] != "nameserver" {
			continue
		}
		ip, err := netip.ParseAddr(f[1])
		if err != nil || ip.IsLoopback() || !ip.Is4() {
			continue
		}
		out = append(out, ip.String())
	}
	return out
}
