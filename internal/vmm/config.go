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
	// Confine limits what QEMU may do once it has opened its devices; nil runs it as
	// started (root, no filter).
	Confine *Confinement

	// driveFiles are the drives' descriptors of a confined QEMU (Start opens them).
	driveFiles [][2]*os.File
}

// Confinement is how far QEMU is confined on the host. QEMU opens everything it needs at
// start (kernel, RAM file, drives, tap descriptor, console log, QMP socket) and later
// receives snapshot streams as descriptors over QMP, so it can drop everything after that.
type Confinement struct {
	// UID and GID QEMU switches to (-runas) before the guest starts; both 0 keep root.
	// QEMU then holds no capability: it can open no other file its user may not, signal
	// or trace no process of another user, and no set*uid call brings root back.
	UID, GID int
	// Chroot is an empty directory QEMU chroots into (-chroot) before the guest starts,
	// so a compromised QEMU sees no host file by name; "" stays in the host's root.
	Chroot string
	// Seccomp installs QEMU's system call filter (-sandbox on): no obsolete calls, no
	// fork or exec (snapshot streams go through descriptors, not exec: URIs), no
	// scheduler or resource-limit changes, and no_new_privs. set*uid stays allowed:
	// QEMU 7.2 installs the filter before -runas switches user (elevateprivileges=deny
	// kills it there), and once it runs as UID it has nothing to elevate to.
	Seccomp bool
}

// driveFDSet is the fd set of a confined QEMU's first drive (the next drives follow).
const driveFDSet = 10

// SeccompPolicy is the -sandbox argument Confinement.Seccomp gives QEMU.
const SeccompPolicy = "on,obsolete=deny,spawn=deny,resourcecontrol=deny"

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
	if k := c.Confine; k != nil {
		if k.UID < 0 || k.GID < 0 || (k.UID == 0) != (k.GID == 0) {
			return fmt.Errorf("vmm: confinement uid %d gid %d: both positive or both 0", k.UID, k.GID)
		}
		if k.Chroot != "" && !filepath.IsAbs(k.Chroot) {
			return fmt.Errorf("vmm: chroot %q must be absolute", k.Chroot)
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

// extraFiles are the descriptors QEMU inherits, in the order Args numbers them: tap
// queues, then (confined) each drive's read-write and read-only descriptor.
func (c *Config) extraFiles() []*os.File {
	var fs []*os.File
	for _, n := range c.NICs {
		if n.TapFile != nil {
			fs = append(fs, n.TapFile)
		}
	}
	for _, d := range c.driveFiles {
		fs = append(fs, d[0], d[1])
	}
	return fs
}

// passDrives: a confined QEMU gets its drives as descriptors (an fd set per drive, one
// read-write and one read-only descriptor), not paths. QEMU reopens an image by name when
// its permissions change — every migration's end inactivates the drives, every restore's
// activates them — which a chrooted or unprivileged QEMU could not; from an fd set it
// duplicates the descriptor of the access mode it wants.
func (c *Config) passDrives() bool { return c.Confine != nil }

// openDrives opens the descriptors passDrives hands QEMU; the caller closes them once
// QEMU has started.
func (c *Config) openDrives() error {
	if !c.passDrives() {
		return nil
	}
	for _, d := range c.Drives {
		mode := os.O_RDWR
		if d.ReadOnly {
			mode = os.O_RDONLY
		}
		rw, err := os.OpenFile(d.Path, mode, 0)
		if err != nil {
			c.closeDrives()
			return fmt.Errorf("vmm: drive %s: %w", d.ID, err)
		}
		ro, err := os.Open(d.Path)
		if err != nil {
			rw.Close()
			c.closeDrives()
			return fmt.Errorf("vmm: drive %s: %w", d.ID, err)
		}
		c.driveFiles = append(c.driveFiles, [2]*os.File{rw, ro})
	}
	return nil
}

func (c *Config) closeDrives() {
	for _, d := range c.driveFiles {
		d[0].Close()
		d[1].Close()
	}
	c.driveFiles = nil
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
	taps := 0
	for _, n := range c.NICs {
		if n.TapFile != nil {
			taps++
		}
	}
	for n, d := range c.Drives {
		format, cache := d.Format, d.Cache
		if format == "" {
			format = "raw"
		}
		if cache == "" {
			cache = "writeback"
		}
		file := optValue(d.Path)
		if c.passDrives() {
			set := driveFDSet + n
			// Descriptors numbered after the taps' (extraFiles).
			a = append(a, "-add-fd", fmt.Sprintf("fd=%d,set=%d", 3+taps+2*n, set),
				"-add-fd", fmt.Sprintf("fd=%d,set=%d", 4+taps+2*n, set))
			file = fmt.Sprintf("/dev/fdset/%d", set)
		}
		drive := fmt.Sprintf("id=%s,file=%s,format=%s,if=none,cache=%s,aio=threads",
			d.ID, file, format, cache)
		if d.ReadOnly {
			drive += ",readonly=on"
		}
		if c.passDrives() {
			// QEMU's image locks (OFD locks) taken through the fd set's two descriptors
			// conflict with each other when a restore or a snapshot's end re-activates the
			// drive ("Failed to get write lock"). What they guard, one QEMU per image,
			// the caller guarantees: each drive is one VM's own file.
			drive += ",file.locking=off"
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
	if k := c.Confine; k != nil {
		if k.Seccomp {
			a = append(a, "-sandbox", SeccompPolicy)
		}
		if k.UID != 0 || k.GID != 0 {
			a = append(a, "-runas", fmt.Sprintf("%d:%d", k.UID, k.GID))
		}
		if k.Chroot != "" {
			a = append(a, "-chroot", k.Chroot)
		}
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
