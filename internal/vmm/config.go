package vmm

import (
	"errors"
	"fmt"
	"net/netip"
	"os"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
)

// Accel is QEMU's accelerator.
type Accel string

const (
	AccelTCG Accel = "tcg"
	AccelKVM Accel = "kvm"
)

// MemoryBackendID is the id of the RAM backend of every VM this package starts. Migration
// streams name RAM blocks by it, so any stream loads into any VM of the same shape.
const MemoryBackendID = "mem"

// Memory is guest RAM, always a file (memory-backend-file), so a snapshot of a VM whose
// RAM is shared is only its device state, and a restore can map a template's RAM file
// copy-on-write.
type Memory struct {
	SizeMiB int
	// Path is the RAM file. With Share it is the guest memory itself (MAP_SHARED): after a
	// stop it is the memory image. Without Share the file is mapped MAP_PRIVATE: reads come
	// from it, guest writes go to private copies and the file never changes.
	Path  string
	Share bool
}

// Drive is a virtio-blk disk backed by a host file.
type Drive struct {
	ID       string
	Path     string
	Format   string // "raw" (default) or "qcow2"
	ReadOnly bool
	// Cache is QEMU's cache mode; "" means writeback (every mode measured the same under TCG).
	Cache string
}

// HostForward forwards a host TCP address to a guest port (user networking).
type HostForward struct {
	Host      netip.AddrPort
	GuestPort int
}

// NIC is a virtio-net device on a tap device (by name, or an open queue descriptor for a
// tap in another network namespace, both created by the caller) or on user-mode
// networking with host forwards.
type NIC struct {
	ID  string
	MAC string // "" lets QEMU choose
	Tap string
	// TapFile is an open tap queue QEMU inherits (-netdev tap,fd=N); the caller may close
	// its copy once Start returns.
	TapFile *os.File
	User    bool
	Forward []HostForward
}

// Config describes one QEMU microvm process. The device list (drives, then NICs, each in
// slice order) must be identical between a VM and every restore of its snapshots: the
// migration stream names devices by their position.
type Config struct {
	// Binary is the QEMU executable; "" means qemu-system-x86_64 from PATH.
	Binary  string
	Accel   Accel
	CPUs    int
	Memory  Memory
	Kernel  string // PVH vmlinux (or bzImage)
	Initrd  string
	Cmdline string
	// TSCKHz is appended as tsc_early_khz= under TCG, where a guest calibrating its TSC
	// hangs in one boot of five. Start fills it from the host when 0.
	TSCKHz int
	// TBSizeMiB caps TCG's translation cache (0: QEMU's default), which is private memory of
	// every VM and so bounds the cost of an idle fork.
	TBSizeMiB int

	ConsoleLog string // guest serial console
	QMPSocket  string
	PIDFile    string
	// LogFile receives QEMU's own stdout and stderr.
	LogFile string

	Drives []Drive
	NICs   []NIC
	// Incoming starts QEMU waiting for a migration stream (-incoming defer): the state of a
	// snapshot is loaded through QMP, after the migration capabilities are set.
	Incoming bool
}

var idRE = regexp.MustCompile(`^[A-Za-z][A-Za-z0-9_-]{0,31}$`)
var macRE = regexp.MustCompile(`^([0-9a-fA-F]{2}:){5}[0-9a-fA-F]{2}$`)
var tapRE = regexp.MustCompile(`^[A-Za-z0-9_.-]{1,15}$`)

// Validate reports the first problem with the configuration.
func (c *Config) Validate() error {
	if c.Accel != AccelTCG && c.Accel != AccelKVM {
		return fmt.Errorf("vmm: accel %q: want %q or %q", c.Accel, AccelTCG, AccelKVM)
	}
	if c.CPUs < 1 || c.CPUs > 64 {
		return fmt.Errorf("vmm: cpus %d out of range 1..64", c.CPUs)
	}
	if c.Memory.SizeMiB < 16 {
		return fmt.Errorf("vmm: memory %d MiB: at least 16 MiB", c.Memory.SizeMiB)
	}
	for name, p := range map[string]string{"kernel": c.Kernel, "RAM file": c.Memory.Path,
		"QMP socket": c.QMPSocket, "console log": c.ConsoleLog} {
		if !filepath.IsAbs(p) {
			return fmt.Errorf("vmm: %s path %q must be absolute", name, p)
		}
	}
	for name, p := range map[string]string{"initrd": c.Initrd, "pidfile": c.PIDFile, "log": c.LogFile} {
		if p != "" && !filepath.IsAbs(p) {
			return fmt.Errorf("vmm: %s path %q must be absolute", name, p)
		}
	}
	if strings.ContainsAny(c.Cmdline, "\n\x00") {
		return errors.New("vmm: kernel command line contains a newline or NUL")
	}
	ids := map[string]bool{MemoryBackendID: true}
	for _, d := range c.Drives {
		if err := d.validate(); err != nil {
			return err
		}
		if ids[d.ID] {
			return fmt.Errorf("vmm: duplicate device id %q", d.ID)
		}
		ids[d.ID] = true
	}
	for _, n := range c.NICs {
		if err := n.validate(); err != nil {
			return err
		}
		if ids[n.ID] {
			return fmt.Errorf("vmm: duplicate device id %q", n.ID)
		}
		ids[n.ID] = true
	}
	return nil
}

func (d Drive) validate() error {
	if !idRE.MatchString(d.ID) {
		return fmt.Errorf("vmm: drive id %q: want a letter then letters, digits, _ or -", d.ID)
	}
	if !filepath.IsAbs(d.Path) {
		return fmt.Errorf("vmm: drive %s: path %q must be absolute", d.ID, d.Path)
	}
	switch d.Format {
	case "", "raw", "qcow2":
	default:
		return fmt.Errorf("vmm: drive %s: format %q: want raw or qcow2", d.ID, d.Format)
	}
	switch d.Cache {
	case "", "none", "writeback", "writethrough", "directsync", "unsafe":
	default:
		return fmt.Errorf("vmm: drive %s: cache mode %q unknown", d.ID, d.Cache)
	}
	return nil
}

func (n NIC) validate() error {
	if !idRE.MatchString(n.ID) {
		return fmt.Errorf("vmm: nic id %q: want a letter then letters, digits, _ or -", n.ID)
	}
	if n.MAC != "" && !macRE.MatchString(n.MAC) {
		return fmt.Errorf("vmm: nic %s: MAC %q malformed", n.ID, n.MAC)
	}
	kinds := 0
	for _, set := range []bool{n.Tap != "", n.TapFile != nil, n.User} {
		if set {
			kinds++
		}
	}
	if kinds != 1 {
		return fmt.Errorf("vmm: nic %s: want exactly one of a tap name, a tap file or user networking", n.ID)
	}
	if n.Tap != "" && !tapRE.MatchString(n.Tap) {
		return fmt.Errorf("vmm: nic %s: tap name %q invalid", n.ID, n.Tap)
	}
	if !n.User && len(n.Forward) > 0 {
		return fmt.Errorf("vmm: nic %s: host forwards need user networking", n.ID)
	}
	for _, f := range n.Forward {
		if !f.Host.IsValid() || !f.Host.Addr().Is4() {
			return fmt.Errorf("vmm: nic %s: forward host %v: want an IPv4 address and port", n.ID, f.Host)
		}
		if f.GuestPort < 1 || f.GuestPort > 65535 {
			return fmt.Errorf("vmm: nic %s: guest port %d out of range", n.ID, f.GuestPort)
		}
	}
	return nil
}

// optValue escapes a value for QEMU's key=value,... option syntax, where a comma is
// written twice.
func optValue(s string) string { return strings.ReplaceAll(s, ",", ",,") }

// extraFiles are the descriptors QEMU inherits, in the order Args numbers them.
func (c *Config) extraFiles() []*os.File {
	var fs []*os.File
	for _, n := range c.NICs {
		if n.TapFile != nil {
			fs = append(fs, n.TapFile)
		}
	}
	return fs
}

// Args is QEMU's command line (without the binary). It does not validate; Start does.
func (c *Config) Args() []string {
	a := []string{
		"-M", "microvm,memory-backend=" + MemoryBackendID, // acpi and rtc stay on: see package doc
		"-nodefaults", "-no-user-config", "-display", "none", "-no-reboot",
	}
	switch c.Accel {
	case AccelKVM:
		a = append(a, "-accel", "kvm", "-cpu", "host")
	default:
		accel := "tcg"
		if c.TBSizeMiB > 0 {
			accel += ",tb-size=" + strconv.Itoa(c.TBSizeMiB)
		}
		a = append(a, "-accel", accel, "-cpu", "max")
	}
	a = append(a, "-smp", strconv.Itoa(c.CPUs), "-m", strconv.Itoa(c.Memory.SizeMiB)+"M",
		"-object", fmt.Sprintf("memory-backend-file,id=%s,size=%dM,mem-path=%s,share=%s",
			MemoryBackendID, c.Memory.SizeMiB, optValue(c.Memory.Path), onOff(c.Memory.Share)),
		"-kernel", c.Kernel)
	if c.Initrd != "" {
		a = append(a, "-initrd", c.Initrd)
	}
	a = append(a, "-append", c.cmdline(),
		"-serial", "file:"+c.ConsoleLog,
		"-qmp", "unix:"+optValue(c.QMPSocket)+",server=on,wait=off")
	if c.PIDFile != "" {
		a = append(a, "-pidfile", c.PIDFile)
	}
	for _, d := range c.Drives {
		format, cache := d.Format, d.Cache
		if format == "" {
			format = "raw"
		}
		if cache == "" {
			cache = "writeback"
		}
		drive := fmt.Sprintf("id=%s,file=%s,format=%s,if=none,cache=%s,aio=threads",
			d.ID, optValue(d.Path), format, cache)
		if d.ReadOnly {
			drive += ",readonly=on"
		}
		a = append(a, "-drive", drive, "-device", "virtio-blk-device,drive="+d.ID)
	}
	fd := 3 // inherited descriptors (ExtraFiles) start after stdin, stdout, stderr
	for _, n := range c.NICs {
		var nd string
		switch {
		case n.Tap != "":
			nd = fmt.Sprintf("tap,id=%s,ifname=%s,script=no,downscript=no,vhost=off", n.ID, n.Tap)
		case n.TapFile != nil:
			nd = fmt.Sprintf("tap,id=%s,fd=%d,vhost=off", n.ID, fd)
			fd++
		default:
			nd = "user,id=" + n.ID
			for _, f := range n.Forward {
				nd += fmt.Sprintf(",hostfwd=tcp:%s:%d-:%d", f.Host.Addr(), f.Host.Port(), f.GuestPort)
			}
		}
		dev := "virtio-net-device,netdev=" + n.ID
		if n.MAC != "" {
			dev += ",mac=" + n.MAC
		}
		a = append(a, "-netdev", nd, "-device", dev)
	}
	if c.Incoming {
		a = append(a, "-incoming", "defer")
	}
	return a
}

// cmdline adds tsc_early_khz under TCG unless the caller set it.
func (c *Config) cmdline() string {
	if c.Accel == AccelKVM || c.TSCKHz <= 0 || strings.Contains(c.Cmdline, "tsc_early_khz=") {
		return c.Cmdline
	}
	return strings.TrimSpace(c.Cmdline + " tsc_early_khz=" + strconv.Itoa(c.TSCKHz))
}

func onOff(b bool) string {
	if b {
		return "on"
	}
	return "off"
}
