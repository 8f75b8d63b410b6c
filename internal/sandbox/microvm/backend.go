// Package microvm runs every sandbox in its own QEMU microvm (-M microvm): a guest kernel
// of its own (Debian's cloud kernel as a PVH vmlinux), an initramfs that mounts the
// sandbox's root disk and starts envd as the guest's PID 1, and KVM where the host runs
// guests with it, TCG (software emulation) elsewhere.
//
// Root disk: the sandbox's layered root (the template's sealed overlaybd layers plus a
// writable upper of its own, package rootfs) served as a file through FUSE and attached as
// a virtio-blk drive, so templates, lazily fetched layers and the repository work as for
// the OCI backend's block roots. Templates must be layered; a directory template cannot
// boot a VM.
//
// Network: the VM is its network slot (package network): a tap in the slot's namespace,
// joined to the slot's veth, with the slot's MAC and address in the guest (tap.go). The
// node reaches envd at the slot's address, as for containers.
//
// Processes: QEMU (started and driven over QMP by package vmm) runs in a process group of
// its own and survives the node; its pidfile in the sandbox directory lets Reconcile find
// it. With the data plane (Config.DataPlane) serving the root disks, a restart adopts
// every VM the orchestrator still knows (adopt.go); without it their disks died with the
// previous process, and Reconcile kills every QEMU it finds and removes what they used.
package microvm

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"sync"
	"time"

	"github.com/aenv-dev/aenv/internal/network"
	"github.com/aenv-dev/aenv/internal/sandbox"
	"github.com/aenv-dev/aenv/internal/storage/stack"
	"github.com/aenv-dev/aenv/internal/vmm"
)

// ErrUnsupported wraps sandbox.ErrUnsupported for what this backend cannot do (yet).
var ErrUnsupported = fmt.Errorf("microvm: %w", sandbox.ErrUnsupported)

// ErrExists means a sandbox with that id already exists on this node.
var ErrExists = errors.New("microvm: sandbox already exists")

// Acceleration modes for Config.Accel.
const (
	AccelAuto = "auto"
	AccelTCG  = "tcg"
	AccelKVM  = "kvm"
)

// Config configures the backend. Zero values take the defaults shown.
type Config struct {
	// DataDir holds one directory per sandbox (DataDir/sandboxes/<id>): its disk's upper,
	// the FUSE mount serving the disk, QEMU's pidfile, QMP socket and console log.
	DataDir string
	// EnvdPath is the host's envd binary; it is packed into each boot's initramfs.
	EnvdPath string
	// EnvdPort is where envd listens in the guest. Default 49983.
	EnvdPort int
	// GuestDir holds the guest kernel and initramfs that `make guest` builds. Default:
	// the directory "microvm" next to EnvdPath (bin/microvm for bin/envd).
	GuestDir string
	// Kernel is the guest kernel (an uncompressed vmlinux or a bzImage). Default
	// GuestDir/vmlinux: a host that needs a special guest kernel sets it.
	Kernel string
	// Initrd is the guest initramfs (without envd). Default GuestDir/initrd.img.
	Initrd string
	// QEMU is the qemu-system-x86_64 binary. Default "qemu-system-x86_64" from PATH.
	QEMU string
	// QEMUUser is "uid:gid", the user every QEMU switches to once it has opened its
	// devices (-runas). Default DefaultQEMUUser, a user no account has: QEMU then owns no
	// file on the host. Unconfined runs QEMU as root without a chroot or a seccomp filter
	// (debugging only); see docs/operations.md for what confinement covers.
	QEMUUser   string
	Unconfined bool
	// Accel is auto (default: KVM when a probe guest boots with it within 10 s, else TCG),
	// tcg or kvm.
	Accel string
	// TSCKHz is the host TSC rate given to TCG guests (tsc_early_khz). Default: the host
	// kernel's calibration (vmm.HostTSCKHz).
	TSCKHz int
	// TBSizeMiB caps TCG's translation cache per VM (0: QEMU's default, 1 GiB reserved and
	// touched as code is translated). The cache is private memory of every QEMU: an idle
	// fork holds ~12.5 MiB of it (huge pages off: thp.go), a third of its PSS. A cap below
	// that saves memory but makes TCG flush and retranslate: 8 MiB saved 6–8 MiB per fork
	// and slowed boots and first answers after a restore several times over, so none is
	// set by default.
	TBSizeMiB int
	// SnapshotPool is how many VMs restored from a snapshot's memory image the backend
	// keeps ready (stopped) per snapshot once a sandbox was created from it, so the next
	// create only continues one (pool.go). 0 keeps none. SnapshotPoolMax caps the pooled
	// VMs of all snapshots together (default 4 × SnapshotPool); each holds a network slot
	// and its QEMU's private memory (~30–40 MiB under TCG).
	SnapshotPool    int
	SnapshotPoolMax int
	// RAMDir holds the guest RAM files (memory-backend-file); it must be a tmpfs. Default
	// /dev/shm/aenv-microvm-<hash of DataDir>.
	RAMDir string
	// MemoryMB and CPUs are the defaults for sandboxes whose plan sets none. Default 256, 1.
	MemoryMB int
	CPUs     int
	// Network configures the slot pool (bridge, subnet, warm pool size).
	Network network.Config
	// ResolvConf is the file whose (non-loopback) nameservers the guest uses when
	// Network.DNS names none. Default /etc/resolv.conf.
	ResolvConf string
	// LayerResolver opens sealed layers that have a digest but no local path.
	LayerResolver stack.Resolver
	// DataPlane serves root disks from the data-plane process (`aenv dataplane`), so they
	// and their VMs outlive this process and a restart adopts them (adopt.go). Nil serves
	// them in this process: a restart then removes every VM.
	DataPlane DataPlane `json:"-"`
	// BlobFetcher fetches the memory images of captures made on other nodes (by digest,
	// verified) from the repository. Nil: such captures cannot be restored here.
	BlobFetcher BlobFetcher `json:"-"`
	Logger      *slog.Logger
}

func (c *Config) defaults() error {
	if c.DataDir == "" {
		return errors.New("microvm: Config.DataDir is required")
	}
	if c.EnvdPath == "" {
		return errors.New("microvm: Config.EnvdPath is required")
	}
	if c.EnvdPort == 0 {
		c.EnvdPort = 49983
	}
	if c.GuestDir == "" {
		c.GuestDir = filepath.Join(filepath.Dir(c.EnvdPath), "microvm")
	}
	if c.Kernel == "" {
		c.Kernel = filepath.Join(c.GuestDir, "vmlinux")
	}
	if c.Initrd == "" {
		c.Initrd = filepath.Join(c.GuestDir, "initrd.img")
	}
	for _, f := range []string{c.EnvdPath, c.Kernel, c.Initrd} {
		if fi, err := os.Stat(f); err != nil || !fi.Mode().IsRegular() {
			return fmt.Errorf("microvm: %s is not a file (`make guest` builds the guest): %v", f, err)
		}
	}
	if c.QEMU == "" {
		c.QEMU = "qemu-system-x86_64"
	}
	p, err := exec.LookPath(c.QEMU)
	if err != nil {
		return fmt.Errorf("microvm: %s not found (Debian package qemu-system-x86): %w", c.QEMU, err)
	}
	c.QEMU = p
	switch c.Accel {
	case "":
		c.Accel = AccelAuto
	case AccelAuto, AccelTCG, AccelKVM:
	default:
		return fmt.Errorf("microvm: Accel %q is not auto, tcg or kvm", c.Accel)
	}
	if c.Accel != AccelKVM && c.TSCKHz == 0 {
		if c.TSCKHz, err = vmm.HostTSCKHz(); err != nil {
			return fmt.Errorf("microvm: host TSC rate (set it in the config): %w", err)
		}
	}
	if c.DataDir, err = filepath.Abs(c.DataDir); err != nil {
		return fmt.Errorf("microvm: data dir: %w", err)
	}
	if c.RAMDir == "" {
		// One per data dir: Reconcile removes every RAM file in it that it does not know.
		sum := sha256.Sum256([]byte(c.DataDir))
		c.RAMDir = "/dev/shm/aenv-microvm-" + hex.EncodeToString(sum[:4])
	}
	if c.TBSizeMiB < 0 {
		return fmt.Errorf("microvm: TBSizeMiB %d is negative", c.TBSizeMiB)
	}
	if c.SnapshotPool < 0 || c.SnapshotPoolMax < 0 {
		return fmt.Errorf("microvm: snapshot pool %d (max %d) is negative", c.SnapshotPool, c.SnapshotPoolMax)
	}
	if c.SnapshotPoolMax == 0 {
		c.SnapshotPoolMax = 4 * c.SnapshotPool
	}
	if c.MemoryMB == 0 {
		c.MemoryMB = 256
	}
	if c.CPUs == 0 {
		c.CPUs = 1
	}
	if c.QEMUUser == "" {
		c.QEMUUser = DefaultQEMUUser
	}
	if _, _, err := parseUser(c.QEMUUser); err != nil {
		return err
	}
	if c.ResolvConf == "" {
		c.ResolvConf = "/etc/resolv.conf"
	}
	c.defaultDNS()
	if c.Logger == nil {
		c.Logger = slog.Default()
	}
	return nil
}

// Backend is the microVM backend. Safe for concurrent use.
type Backend struct {
	cfg    Config
	accel  vmm.Accel
	pool   *network.Pool
	log    *slog.Logger
	initrd string // the boot initramfs: cfg.Initrd plus envd
	dns    []string
	// crashAt is the debug crash point (CrashPointEnv), read once at New.
	crashAt string
	// confine is how every QEMU is confined (nil: Config.Unconfined).
	confine *vmm.Confinement

	// fetching serialises fetches of one memory blob (memfetch.go).
	fetching keyedMutex

	// vmpool keeps restored VMs of snapshots ready (pool.go).
	vmpool *vmPool

	mu        sync.Mutex
	instances map[string]*Instance
}

var _ sandbox.Backend = (*Backend)(nil)

// New checks the guest files and QEMU, packs envd into the boot initramfs and creates the
// network pool. Call Reconcile before the first Launch.
func New(ctx context.Context, cfg Config) (*Backend, error) {
	if err := cfg.defaults(); err != nil {
		return nil, err
	}
	for _, d := range []string{cfg.sandboxesDir(), cfg.RAMDir} {
		if err := os.MkdirAll(d, 0o700); err != nil {
			return nil, fmt.Errorf("microvm: %w", err)
		}
	}
	b := &Backend{cfg: cfg, log: cfg.Logger, instances: map[string]*Instance{}, dns: cfg.guestDNS(),
		crashAt: os.Getenv(CrashPointEnv)}
	if b.crashAt != "" {
		if !slices.Contains([]string{crashCaptureState, crashCaptureSealed, crashCaptureRAM, crashForkLaunched}, b.crashAt) {
			return nil, fmt.Errorf("microvm: %s=%q names no crash point", CrashPointEnv, b.crashAt)
		}
		b.log.Warn("microvm: debug crash point armed: the process kills itself there", "point", b.crashAt)
	}
	if err := b.sweepFetchTemps(); err != nil {
		return nil, err
	}
	var err error
	if b.confine, err = cfg.confinement(); err != nil {
		return nil, err
	}
	b.initrd = filepath.Join(cfg.DataDir, "initrd.img")
	if err := buildInitrd(cfg.Initrd, cfg.EnvdPath, b.initrd); err != nil {
		return nil, err
	}
	b.accel = vmm.Accel(cfg.Accel)
	if cfg.Accel == AccelAuto {
		// /dev/kvm may exist and still not run a stock guest (a nested-virtualisation
		// module): only a probe boot tells.
		probe := &vmm.AccelProbe{Timeout: 10 * time.Second, Logger: b.log}
		a, err := probe.Detect(ctx, cfg.QEMU, cfg.Kernel, cfg.DataDir)
		if err != nil {
			return nil, fmt.Errorf("microvm: %w", err)
		}
		b.accel = a
	}
	if b.accel == vmm.AccelTCG {
		if err := noHugePages(); err != nil {
			b.log.Warn("microvm: QEMU keeps transparent huge pages (more memory per VM)", "err", err)
		}
	}
	pool, err := network.New(ctx, cfg.Network)
	if err != nil {
		return nil, err
	}
	b.pool = pool
	if err := pinBridgeMAC(pool.Gateway()); err != nil {
		// Restored guests then reach their gateway only after their ARP entry expires.
		b.log.Warn("microvm: bridge MAC not pinned", "err", err)
	}
	b.vmpool = newVMPool(b, cfg.SnapshotPool, cfg.SnapshotPoolMax)
	b.log.Info("microvm backend ready", "qemu", cfg.QEMU, "accel", b.accel, "kernel", cfg.Kernel, "tsc_khz", cfg.TSCKHz)
	return b, nil
}

func (c *Config) sandboxesDir() string { return filepath.Join(c.DataDir, "sandboxes") }

// chrootDir is the empty directory confined QEMUs chroot into.
func (c *Config) chrootDir() string { return filepath.Join(c.DataDir, "qemu-root") }

// Name implements sandbox.Backend.
func (b *Backend) Name() string { return "microvm" }

// Close stops the snapshot pool's VMs and releases the network pool's warm slots. Running sandboxes keep running; a
// restart's Reconcile adopts them (data plane) or removes them. The RAM directory goes
// when nothing is left in it (a node whose sandboxes were stopped leaves no trace on
// tmpfs).
func (b *Backend) Close(ctx context.Context) error {
	b.vmpool.close()
	_ = os.Remove(b.cfg.imagesDir())
	_ = os.Remove(b.cfg.RAMDir)
	return b.pool.Close(ctx)
}

// Pool exposes the network pool (tests, diagnostics).
func (b *Backend) Pool() *network.Pool { return b.pool }

var idRE = regexp.MustCompile(`^[A-Za-z0-9][A-Za-z0-9_-]{0,127}$`)
