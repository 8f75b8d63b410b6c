// Package oci runs sandboxes as OCI containers with an OCI runtime binary (runc, crun or
// runsc) from bundles it generates: own pid, mount, ipc, uts, cgroup and network namespaces
// (and a user namespace where the host allows), a root filesystem, a seccomp profile,
// reduced capabilities and cgroup limits. envd, bind-mounted read-only from the host, is
// every sandbox's init.
//
// Root filesystems: a template converted to overlaybd layers gives each sandbox a layered
// block root (package rootfs: the template's sealed layers plus a writable upper of its
// own, through FUSE and a loop device, mounted as ext4, id-mapped for the user namespace).
// Such sandboxes snapshot while running (freeze, seal the upper into a new shared layer,
// thaw), fork (one snapshot, N launches on fresh uppers over its layers) and pause to disk
// (snapshot, then stop; resume relaunches from the capture under the same id). Only the
// filesystem is captured: children and resumed sandboxes start fresh processes. A template
// that is only a directory gives a per-sandbox overlay over it, which cannot snapshot
// (ErrUnsupported) and pauses in place.
//
// User namespaces: when the probe at New shows the runtime and kernel allow it (runc 1.1.5
// on Linux 6.18 does), each sandbox's root is mapped to its own unprivileged 65536-id host
// range (UIDBase + slot*65536). The shared template directory is not chowned: it is
// bind-mounted with an id-mapping (mount_setattr MOUNT_ATTR_IDMAP) as the overlay's lower,
// and the per-sandbox upper is owned by the mapped root. Where the probe fails (old kernel,
// runtime without user-namespace support, a data dir that others cannot traverse) and
// UserNamespace is "auto", sandboxes run without one, with a warning: root inside is then
// host root, still confined by namespaces, seccomp, the reduced capability set,
// no-new-privileges and cgroups.
//
// The network namespace is made by the host (package network), so it belongs to the host's
// user namespace: a sandbox root holds no network capability over it (cannot change its
// address, routes or MAC, send raw frames, or spoof ARP). A consequence is that `runc exec`
// into a user-namespaced sandbox fails (runc 1.1 joins the user namespace first and may
// then not join the host-owned network namespace); nothing here needs it, since envd starts
// every process in the sandbox.
package oci

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
	"sync"
	"time"

	"github.com/aenv-dev/aenv/internal/network"
	"github.com/aenv-dev/aenv/internal/rootfs"
	"github.com/aenv-dev/aenv/internal/sandbox"
	"github.com/aenv-dev/aenv/internal/steptime"
	"github.com/aenv-dev/aenv/internal/storage/stack"
	"golang.org/x/sys/unix"
)

// ErrUnsupported is returned for operations this backend cannot do for a sandbox (a
// snapshot of a sandbox on a directory template). It wraps sandbox.ErrUnsupported.
var ErrUnsupported = fmt.Errorf("oci: %w", sandbox.ErrUnsupported)

// ErrExists means a sandbox with that id already has a bundle on this node.
var ErrExists = errors.New("oci: sandbox already exists")

// ErrNoRuntime means no OCI runtime could run a container on this host.
var ErrNoRuntime = errors.New("oci: no working OCI runtime")

// Snapshot quiesce modes for Config.SnapshotQuiesce.
const (
	QuiesceFreeze = "freeze"
	QuiesceSync   = "sync"
)

// User namespace modes for Config.UserNamespace.
const (
	UserNSAuto = "auto" // use one when the probe shows runtime and kernel support it
	UserNSOn   = "on"   // require one
	UserNSOff  = "off"  // never
)

// Config configures the backend. Zero values take the defaults shown.
type Config struct {
	// DataDir holds bundles (DataDir/sandboxes/<id>) and the runtime state (DataDir/<runtime>).
	DataDir string
	// EnvdPath is the host's envd binary, bind-mounted read-only into every sandbox.
	EnvdPath string
	// EnvdArgs follow envdMount in the init's argv. Default (nil): containerEnvdArgs.
	EnvdArgs []string
	// InitArgs replaces the init's whole argv (default: envdMount followed by EnvdArgs), for
	// tests and custom inits; envd is still mounted.
	InitArgs []string
	// EnvdPort is where envd listens inside the sandbox. Default 49983.
	EnvdPort int
	// Runtime is "auto" (or ""), "runc", "crun", "runsc" or a path to one of them.
	Runtime string
	// UserNamespace is auto (default), on or off.
	UserNamespace string
	// UIDBase is the first host uid of the ranges sandbox roots map to; each sandbox gets
	// its own 65536 ids (by network slot index), UIDRanges of them in all. 0 (default):
	// the lowest block no other node on the host holds. Every node records its block in
	// UIDRangeFile, and a block that overlaps another node's is refused.
	UIDBase uint32
	// UIDRanges is how many 65536-id ranges the node reserves: the most sandboxes (and
	// warm network slots) it can hold at once. 0 (default): sized to the host's memory
	// and the ids other nodes left free (autoUIDRanges). New sets it to the count it got.
	UIDRanges int
	// UIDRangeFile is the host-wide record of the nodes' uid blocks. Default
	// DefaultUIDRangeFile.
	UIDRangeFile string
	// WarmContainers is how many containers, created and with envd started, are kept per
	// recently used template (up to 4 templates), so a launch pays neither the runtime nor
	// envd's start. Default 2; negative disables.
	WarmContainers int
	// WarmContainersMax is what a template's warm pool grows to after a burst of launches
	// of it (as many as the burst, for burstHold). Default 16; below WarmContainers it is
	// WarmContainers.
	WarmContainersMax int
	// PidsLimit caps processes per sandbox. Default 1024.
	PidsLimit int64
	// CgroupParent is the cgroup under which sandboxes live. Default "aenv".
	CgroupParent string
	// Network configures the slot pool (bridge, subnet, warm pool size).
	Network network.Config
	// DNS are the sandboxes' nameservers, written to <DataDir>/resolv.conf and bind-mounted
	// (ResolvConf is then ignored). Empty: ResolvConf decides. Either way the nameservers
	// sandboxes are given are reachable on port 53 through the infrastructure deny.
	DNS []netip.Addr
	// ResolvConf is bind-mounted read-only at /etc/resolv.conf in every sandbox: "" (auto)
	// uses the host's /etc/resolv.conf unless its nameservers are loopback addresses (which
	// a sandbox cannot reach), "none" keeps the template's file, anything else is a path.
	ResolvConf string
	// LayerResolver opens sealed layers that have a digest but no local path (lazily,
	// e.g. from a repository through the node's block cache). Without it every layer of
	// a layered root needs an absolute path.
	LayerResolver stack.Resolver
	// DataPlane serves layered roots from the data-plane process, so they survive this
	// one (Reconcile adopts them); nil serves them in this process.
	DataPlane DataPlane
	// OverlayRoots gives sandboxes on layered templates and snapshots an overlay root over
	// a read-only lower shared by every sandbox on the same layers, with a block root of
	// their own as its upper, instead of a block root over all the layers: the layers'
	// files are read and cached once per node, not once per sandbox (sharedlower.go).
	// Snapshots, forks and pause to disk work on both.
	OverlayRoots bool
	// SnapshotQuiesce is how snapshots of block roots make the filesystem consistent:
	// "freeze" (default; fsfreeze, a clean image) or "sync" (syncfs, then a
	// crash-consistent point-in-time seal: a much shorter write stall).
	SnapshotQuiesce string
	// Busybox is a static busybox used to probe the runtime. Default /bin/busybox.
	Busybox string
	Logger  *slog.Logger
}

const idRangeSize = 65536

func (c *Config) defaults() error {
	if c.DataDir == "" {
		return errors.New("oci: Config.DataDir is required")
	}
	if c.EnvdPath == "" {
		return errors.New("oci: Config.EnvdPath is required")
	}
	if fi, err := os.Stat(c.EnvdPath); err != nil || fi.IsDir() || fi.Mode()&0o111 == 0 {
		return fmt.Errorf("oci: envd %s is not an executable file: %v", c.EnvdPath, err)
	}
	if c.EnvdPort == 0 {
		c.EnvdPort = 49983
	}
	if c.Runtime == "" {
		c.Runtime = "auto"
	}
	switch c.UserNamespace {
	case "":
		c.UserNamespace = UserNSAuto
	case UserNSAuto, UserNSOn, UserNSOff:
	default:
		return fmt.Errorf("oci: UserNamespace %q is not auto, on or off", c.UserNamespace)
	}
	if c.UIDRangeFile == "" {
		c.UIDRangeFile = DefaultUIDRangeFile
	}
	// Negative stays negative (not 0, the default), so a Config that went through New
	// once means the same the second time (tests reopen a backend with b.cfg).
	if c.WarmContainers == 0 {
		c.WarmContainers = 2
	}
	if c.WarmContainersMax == 0 {
		c.WarmContainersMax = 16 // newWarmPool raises it to WarmContainers when below
	}
	if c.PidsLimit == 0 {
		c.PidsLimit = 1024
	}
	if c.CgroupParent == "" {
		c.CgroupParent = "aenv"
	}
	switch c.SnapshotQuiesce {
	case "":
		c.SnapshotQuiesce = QuiesceFreeze
	case QuiesceFreeze, QuiesceSync:
	default:
		return fmt.Errorf("oci: SnapshotQuiesce %q is not freeze or sync", c.SnapshotQuiesce)
	}
	if c.Busybox == "" {
		c.Busybox = "/bin/busybox"
	}
	if c.Logger == nil {
		c.Logger = slog.Default()
	}
	switch c.ResolvConf {
	case "":
		c.ResolvConf = hostResolvConf("/etc/resolv.conf")
	case "none":
		c.ResolvConf = ""
	default:
		if fi, err := os.Stat(c.ResolvConf); err != nil || !fi.Mode().IsRegular() {
			return fmt.Errorf("oci: ResolvConf %s is not a file: %v", c.ResolvConf, err)
		}
	}
	abs, err := filepath.Abs(c.DataDir)
	if err != nil {
		return fmt.Errorf("oci: data dir: %w", err)
	}
	c.DataDir = abs
	return nil
}

// Backend is the OCI container backend. Safe for concurrent use.
type Backend struct {
	cfg    Config
	rt     runtimeCLI
	userns bool
	v2     bool
	memsw  bool
	// bootIDs: each container gets a boot id of its own (bindBootID); false under
	// gVisor, whose kernel makes its own.
	bootIDs bool
	// emptyDir masks directories in every sandbox ("": a tmpfs each).
	emptyDir string
	// cgroupViewDir is the /sys/fs/cgroup of sandboxes that see only their hierarchies
	// ("": a tmpfs each; see makeCgroupViewDir).
	cgroupViewDir string
	// cgroupNeed and cgroupRest are the host's v1 cgroup hierarchies sandboxes are a
	// cgroup in and the others (splitCgroupMounts), read once at the start.
	cgroupNeed, cgroupRest []string
	// blankRoot is the skeleton blank warm containers start on ("": none are kept).
	blankRoot string
	pool      *network.Pool
	warm      *warmPool
	log       *slog.Logger
	// usernsFDs are the user namespaces id-mapped mounts are made for.
	usernsFDs *usernsCache
	// nsThreads reroots blank containers (nil: each on a thread of its own).
	nsThreads *nsThreads
	// stopLoopTrim stops the trim of free loop devices (startLoopTrim).
	stopLoopTrim func()
	// lowers are the shared lowers of overlay roots (sharedlower.go).
	lowers *rootfs.Lowers

	mu        sync.Mutex
	instances map[string]*Instance
	// tearing counts the containers of each sandbox id still torn down in the background
	// (StopAfterCapture); seq numbers the container ids used meanwhile.
	tearing   map[string]int
	seq       int
	teardowns sync.WaitGroup

	// layersMu orders snapshots (which add layer files and capture records) against the
	// garbage collection of layer files (see gcLayers).
	layersMu sync.Mutex
}

// The optional behaviours of the sandbox contract this backend has: a renamed method
// fails here instead of silently switching the behaviour off in the orchestrator.
var (
	_ sandbox.Backend           = (*Backend)(nil)
	_ sandbox.PausedDiscarder   = (*Backend)(nil)
	_ sandbox.SnapshotDiscarder = (*Backend)(nil)
	_ sandbox.CaptureReconciler = (*Backend)(nil)
	_ sandbox.WarmForgetter     = (*Backend)(nil)
	_ sandbox.DirectoryBooter   = (*Backend)(nil)
	_ sandbox.CapturedStopper   = (*Instance)(nil)
	_ sandbox.EgressUpdater     = (*Instance)(nil)
)

// New probes the host (which runtime runs a container, whether user namespaces work),
// creates the network pool and returns the backend. Call Reconcile before the first Launch
// so leftovers of an earlier run are cleaned and the warm pool starts.
func New(ctx context.Context, cfg Config) (*Backend, error) {
	if err := cfg.defaults(); err != nil {
		return nil, err
	}
	// Sandbox roots in a user namespace are "others" on the host: they must be able to
	// traverse the data dir down to their rootfs (nothing is listable or readable).
	for _, d := range []string{cfg.DataDir, filepath.Join(cfg.DataDir, "sandboxes")} {
		if err := os.MkdirAll(d, 0o711); err != nil {
			return nil, fmt.Errorf("oci: data dir: %w", err)
		}
		if fi, err := os.Stat(d); err == nil && fi.Mode().Perm()&0o001 == 0 {
			if err := os.Chmod(d, fi.Mode().Perm()|0o011); err != nil {
				return nil, fmt.Errorf("oci: data dir: %w", err)
			}
		}
	}
	if err := cfg.sandboxDNS(); err != nil {
		return nil, err
	}
	emptyDir, err := makeEmptyDir(cfg.DataDir)
	if err != nil {
		cfg.Logger.Warn("oci: masked directories get a tmpfs each", "err", err)
	}
	req := uidRequest{Owner: cfg.DataDir, Base: cfg.UIDBase, Ranges: cfg.UIDRanges}
	if req.Ranges == 0 {
		var si unix.Sysinfo_t
		if err := unix.Sysinfo(&si); err != nil {
			return nil, fmt.Errorf("oci: host memory: %w", err)
		}
		req.Ranges, req.Auto = autoUIDRanges(uint64(si.Totalram)*uint64(si.Unit)), true
	}
	block, err := reserveUIDs(cfg.UIDRangeFile, req)
	if err != nil {
		return nil, err
	}
	cfg.UIDBase, cfg.UIDRanges = block.Base, int(block.Ranges)
	b := &Backend{cfg: cfg, v2: unifiedOnly(), log: cfg.Logger, emptyDir: emptyDir, instances: map[string]*Instance{}, tearing: map[string]int{}, usernsFDs: newUsernsCache()}
	if b.blankRoot, err = makeBlankRoot(cfg.DataDir); err != nil {
		b.log.Warn("oci: no blank warm containers: forks and resumes start their containers on their path", "err", err)
	}
	b.memsw = hostAccountsSwap(b.v2)
	if b.cgroupNeed, b.cgroupRest, err = hostCgroupMounts(); err != nil {
		b.log.Warn("oci: sandboxes join every cgroup hierarchy", "err", err)
	}
	laps := steptime.Start()
	rt, userns, err := b.probe(ctx)
	if err != nil {
		return nil, err
	}
	laps.Lap("probe")
	binPath := rt.bin
	b.rt, b.userns = rt.sealed(b.log), userns
	if rt.cgroupView() && len(b.cgroupNeed) > 0 {
		if b.cgroupViewDir, err = makeCgroupViewDir(cfg.DataDir, b.cgroupNeed); err != nil {
			b.log.Warn("oci: sandboxes' /sys/fs/cgroup is a tmpfs each", "err", err)
		}
	}
	b.bootIDs = rt.name != "runsc"
	pool, err := network.New(ctx, cfg.Network)
	if err != nil {
		return nil, err
	}
	b.pool = pool
	laps.Lap("network")
	// After the pool, which makes the netns directory a mount point.
	cgroups := b.cgroupRest
	if rt.cgroupView() {
		cgroups = b.cgroupNeed
	}
	b.rt.ns = newLaunchNS(cfg.DataDir, network.NetnsDir, []string{cfg.EnvdPath, cfg.ResolvConf}, rt.cgroupView(), cgroups, b.log)
	b.warm = newWarmPool(b, max(cfg.WarmContainers, 0), cfg.WarmContainersMax)
	b.lowers = rootfs.NewLowers(b.lowersDir(), b.diskOpener(), cfg.LayerResolver)
	if b.nsThreads, err = newNSThreads(b.log); err != nil {
		b.log.Warn("oci: blank containers are rerooted each on a thread of its own", "err", err)
	}
	b.stopLoopTrim = b.startLoopTrim()
	b.log.Info("oci backend ready", append([]any{"runtime", rt.name, "bin", binPath, "userns", userns, "cgroup_v2_only", b.v2,
		"uid_base", cfg.UIDBase, "uid_ranges", cfg.UIDRanges, "overlay_roots", cfg.OverlayRoots}, laps.Attrs()...)...)
	return b, nil
}

// Name implements sandbox.Backend.
func (b *Backend) Name() string { return "oci" }

// BootsDirectories implements sandbox.DirectoryBooter: a directory template's sandbox
// runs on a per-sandbox overlay over the directory.
func (b *Backend) BootsDirectories() bool { return true }

// Runtime is the OCI runtime the probe chose ("runc", "crun", "runsc").
func (b *Backend) Runtime() string { return b.rt.name }

// UserNamespaces reports whether sandboxes run in their own user namespace.
func (b *Backend) UserNamespaces() bool { return b.userns }

// Capabilities implements sandbox.Backend. Pause with KeepMemory freezes the cgroup, so
// processes survive and memory stays allocated. Snapshots capture the filesystem only
// (sandboxes on layered block roots; a sandbox on a directory template cannot snapshot):
// children of a fork and sandboxes resumed from a pause to disk boot fresh processes on
// the captured filesystem.
func (b *Backend) Capabilities() sandbox.Capabilities {
	return sandbox.Capabilities{PauseKeepsProcesses: true, Snapshots: true}
}

// Close removes the warm containers and the network pool's warm slots. Running sandboxes
// keep running (a restart adopts them through Reconcile); with none, the data directory's
// bind onto itself goes too.
func (b *Backend) Close(ctx context.Context) error {
	err := errors.Join(b.waitTeardowns(ctx), b.warm.close(ctx), b.pool.Close(ctx), b.usernsFDs.close())
	if b.nsThreads != nil {
		b.nsThreads.close()
	}
	if b.stopLoopTrim != nil {
		b.stopLoopTrim()
	}
	return errors.Join(err, b.rt.ns.release())
}

// Pool exposes the network pool (for tests and diagnostics).
func (b *Backend) Pool() *network.Pool { return b.pool }

var idRE = regexp.MustCompile(`^[A-Za-z0-9][A-Za-z0-9_-]{0,127}$`)

// savedState is written next to the bundle so Reconcile can adopt a sandbox after a restart.
type savedState struct {
	ID          string `json:"id"` // sandbox id; "" for a warm container
	ContainerID string `json:"containerID"`
	LowerDir    string `json:"lowerDir"`
	Block       bool   `json:"block,omitempty"` // a root on layers (adopted when the data plane serves it)
	// Lower is where the shared lower of an overlay root is mounted, LowerLayers its
	// layers; both empty for a block root.
	Lower         string            `json:"lower,omitempty"`
	LowerLayers   []stack.LayerRef  `json:"lowerLayers,omitempty"`
	Resources     sandbox.Resources `json:"resources"`
	SlotIndex     int               `json:"slotIndex"`
	AllowInternet bool              `json:"allowInternet"`
	IDMap         *idMap            `json:"idmap,omitempty"`
	Created       time.Time         `json:"created"`
}

func (b *Backend) layout(id string) layout {
	return layout{dir: filepath.Join(b.cfg.DataDir, "sandboxes", id)}
}

func (b *Backend) cgroupsPath(id string) string { return "/" + b.cfg.CgroupParent + "/" + id }

// viewCgroups are the hierarchies rt sees in its own cgroup root (showCgroupMounts) and
// binds into its sandboxes' /sys/fs/cgroup (specParams.cgroupBinds): for crun, those
// sandboxes need; nil for runc, which sees the host's root.
func (b *Backend) viewCgroups(rt runtimeCLI) []string {
	if rt.cgroupView() {
		return b.cgroupNeed
	}
	return nil
}

// sandboxDNS writes the configured nameservers into the backend's own resolv.conf, and
// lets the network pool's infrastructure deny pass the nameservers sandboxes get.
func (c *Config) sandboxDNS() error {
	if len(c.DNS) > 0 {
		var b strings.Builder
		for _, a := range c.DNS {
			fmt.Fprintf(&b, "nameserver %s\n", a)
		}
		path := filepath.Join(c.DataDir, "resolv.conf")
		if err := os.WriteFile(path, []byte(b.String()), 0o644); err != nil {
			return fmt.Errorf("oci: write the sandboxes' resolv.conf: %w", err)
		}
		c.ResolvConf = path
	}
	c.Network.DNS = nil
	if c.ResolvConf == "" {
		return nil
	}
	raw, err := os.ReadFile(c.ResolvConf)
	if err != nil {
		return fmt.Errorf("oci: %w", err)
	}
	for _, l := range strings.Split(string(raw), "\n") {
		if f := strings.Fields(l); len(f) >= 2 && f[0] == "nameserver" {
			if ip, err := netip.ParseAddr(f[1]); err == nil && ip.Is4() {
				c.Network.DNS = append(c.Network.DNS, ip)
			}
		}
	}
	return nil
}

// hostResolvConf returns path when it names at least one nameserver and none on loopback.
func hostResolvConf(path string) string {
	raw, err := os.ReadFile(path)
	if err != nil {
		return ""
	}
	n := 0
	for _, l := range strings.Split(string(raw), "\n") {
		f := strings.Fields(l)
		if len(f) < 2 || f[0] != "nameserver" {
			continue
		}
		ip, err := netip.ParseAddr(f[1])
		if err != nil || ip.IsLoopback() {
			return ""
		}
		n++
	}
	if n == 0 {
		return ""
	}
	return path
}

// pausedState is this backend's PausedState: the sandbox stays frozen on this node, or,
// with Disk, it was stopped after a snapshot and resumes from that capture.
type pausedState struct {
	ID   string    `json:"id"`
	Disk *Captured `json:"disk,omitempty"`
}

func (p pausedState) Encode() ([]byte, error) { return json.Marshal(p) }

// DecodePaused implements sandbox.Backend.
func (b *Backend) DecodePaused(raw []byte) (sandbox.PausedState, error) {
	var p pausedState
	if err := json.Unmarshal(raw, &p); err != nil || p.ID == "" {
		return nil, fmt.Errorf("oci: bad paused state %q: %v", raw, err)
	}
	if p.Disk != nil {
		if err := p.Disk.validate(); err != nil {
			return nil, err
		}
	}
	return p, nil
}

// resume thaws a sandbox paused in place, or relaunches one paused to disk.
func (b *Backend) resume(ctx context.Context, plan sandbox.LaunchPlan) (sandbox.Instance, error) {
	if ps, ok := plan.Paused.(pausedState); ok && ps.Disk != nil {
		inst, err := b.launchBlock(ctx, plan, ps.Disk.Layers, fromUpperRefs(ps.Disk.Upper), ps.Disk.VirtualSize)
		if err != nil {
			return nil, err
		}
		// The new root references the layers itself; the capture is no longer needed.
		if err := b.discardCapture(ctx, ps.Disk); err != nil {
			b.log.Warn("oci: discard capture after resume", "id", plan.SandboxID, "err", err)
		}
		return inst, nil
	}
	return b.resumeInPlace(ctx, plan)
}

func (b *Backend) resumeInPlace(ctx context.Context, plan sandbox.LaunchPlan) (sandbox.Instance, error) {
	b.mu.Lock()
	inst := b.instances[plan.SandboxID]
	b.mu.Unlock()
	if inst == nil {
		return nil, fmt.Errorf("%w: %s is not on this node", sandbox.ErrGone, plan.SandboxID)
	}
	if err := inst.Resume(ctx); err != nil {
		return nil, err
	}
	return inst, nil
}

func writeJSON(path string, v any) error {
	b, err := json.Marshal(v)
	if err != nil {
		return fmt.Errorf("oci: encode %s: %w", filepath.Base(path), err)
	}
	if err := os.WriteFile(path, b, 0o600); err != nil {
		return fmt.Errorf("oci: write %s: %w", filepath.Base(path), err)
	}
	return nil
}

func lookRuntime(name string) (string, error) {
	p, err := exec.LookPath(name)
	if err != nil {
		return "", fmt.Errorf("oci: runtime %s not found: %w", name, err)
	}
	return p, nil
}
