// Package config loads the node configuration: the embedded defaults (default.toml), then
// an optional TOML file, then AENV_* environment variables. Flags are applied by the caller.
package config

import (
	_ "embed"
	"errors"
	"fmt"
	"net"
	"net/netip"
	"net/url"
	"path/filepath"
	"reflect"
	"regexp"
	"strconv"
	"strings"
	"time"

	"github.com/BurntSushi/toml"
)

//go:embed default.toml
var defaultTOML string

// DefaultTOML is the embedded default configuration, with comments (aenv config print-default).
func DefaultTOML() string { return defaultTOML }

// Config is the node configuration. TOML keys are the field tags; environment variables
// are AENV_ + the upper-cased key path joined by '_'.
type Config struct {
	Listen    string `toml:"listen"`
	DataDir   string `toml:"data_dir"`
	APIKey    string `toml:"api_key"`
	LogLevel  string `toml:"log_level"`
	LogFormat string `toml:"log_format"`
	// DebugListen serves net/http/pprof when set (empty: off). Profiles expose memory
	// contents and can be costly to take, so the default is off and Validate keeps it on
	// loopback unless the user writes another address explicitly.
	DebugListen string `toml:"debug_listen"`
	// MetricsListen serves GET /metrics on a listener of its own, and the API listener
	// then answers 404 there (empty: /metrics is on the API listener). MetricsToken,
	// when set, is the bearer token every /metrics request must carry.
	MetricsListen string     `toml:"metrics_listen"`
	MetricsToken  string     `toml:"metrics_token"`
	Sandbox       Sandbox    `toml:"sandbox"`
	Envd          Envd       `toml:"envd"`
	Backend       Backend    `toml:"backend"`
	Network       Network    `toml:"network"`
	Templates     Templates  `toml:"templates"`
	Volumes       Volumes    `toml:"volumes"`
	Proxy         Proxy      `toml:"proxy"`
	Snapshot      Snapshot   `toml:"snapshot"`
	Repository    Repository `toml:"repository"`
	Cluster       Cluster    `toml:"cluster"`
}

// Sandbox holds lifecycle defaults and limits.
type Sandbox struct {
	DefaultTimeout   Duration `toml:"default_timeout"`
	DefaultTimeoutV1 Duration `toml:"default_timeout_v1"`
	MaxTimeout       Duration `toml:"max_timeout"`
	DefaultCPU       int      `toml:"default_cpu"`
	DefaultMemoryMB  int      `toml:"default_memory_mb"`
	DefaultDiskMB    int      `toml:"default_disk_mb"`
	MaxSandboxes     int      `toml:"max_sandboxes"`
	ShutdownAction   string   `toml:"shutdown_action"`
	// CPUOvercommit bounds one sandbox's cpuCount at host CPUs × this (0: no limit).
	CPUOvercommit float64 `toml:"cpu_overcommit"`
	// MemoryOvercommit bounds the memory that sandboxes holding resources commit together
	// (and so one sandbox's memoryMB) at host memory × this (0: no limit).
	MemoryOvercommit float64 `toml:"memory_overcommit"`
}

// Envd configures the in-sandbox daemon.
type Envd struct {
	Path         string   `toml:"path"`
	Version      string   `toml:"version"`
	ReadyTimeout Duration `toml:"ready_timeout"`
}

// Backend selects the sandbox technology.
type Backend struct {
	Kind    string `toml:"kind"`
	Runtime string `toml:"runtime"`
	// CgroupParent is the cgroup this node's sandboxes live under. The startup reconciler
	// removes every cgroup below it that the node does not know, so two nodes on one host
	// need different parents.
	CgroupParent string `toml:"cgroup_parent"`
	// DataPlane serves layered root disks from the data-plane process (`aenv dataplane`),
	// which outlives the node: sandboxes on layered roots survive a crash, restart or
	// upgrade of `aenv serve`. False serves them from the node itself (they die with it).
	DataPlane bool `toml:"data_plane"`
	// Accel is the microvm backend's acceleration: auto, tcg or kvm.
	Accel string `toml:"accel"`
	// GuestKernel and GuestInitrd are the microvm backend's guest kernel and initramfs;
	// empty: vmlinux and initrd.img in the directory "microvm" next to envd (`make guest`).
	GuestKernel string `toml:"guest_kernel"`
	GuestInitrd string `toml:"guest_initrd"`
	// TBSizeMiB caps the TCG translation cache of each microVM (0: QEMU's default); see
	// docs/operations.md for what a cap saves and costs.
	TBSizeMiB int `toml:"tb_size_mib"`
	// SnapshotPool is how many VMs the microvm backend keeps restored per snapshot (0:
	// none); SnapshotPoolMax caps them across snapshots. See docs/operations.md.
	SnapshotPool    int `toml:"snapshot_pool"`
	SnapshotPoolMax int `toml:"snapshot_pool_max"`
	// QEMUUser is the microvm backend's "uid:gid" for QEMU once its devices are open;
	// empty: microvm.DefaultQEMUUser.
	QEMUUser string `toml:"qemu_user"`
	// UIDBase is the first host uid of the node's sandbox uid ranges; 0 picks a block no
	// other node on the host holds (recorded in /run/aenv/uid-ranges.json).
	UIDBase int `toml:"uid_base"`
	// UIDRanges is how many 65536-id ranges the node reserves: the most sandboxes it
	// holds at once; 0 sizes the block to the host's memory (one range per 4 MiB, 256 to
	// 16384) and to the ids other nodes left free.
	UIDRanges int `toml:"uid_ranges"`
	// WarmContainers is how many containers (created, envd started) the oci backend keeps
	// per recently launched template (0: none); a burst of launches grows a template's
	// pool to the burst's size, up to WarmContainersMax, for ten minutes.
	WarmContainers    int `toml:"warm_containers"`
	WarmContainersMax int `toml:"warm_containers_max"`
	// OverlayRoots gives the oci backend's sandboxes on layered templates an overlay
	// root over a lower shared by every sandbox on the same layers (see
	// docs/operations.md, "Overlay roots over a shared lower").
	OverlayRoots bool `toml:"overlay_roots"`
}

// Network configures the sandboxes' network slots. Like the cgroup parent, the bridge,
// subnet and prefix belong to one node: the startup sweep removes unknown slots.
type Network struct {
	Bridge   string `toml:"bridge"`
	Subnet   string `toml:"subnet"`
	Prefix   string `toml:"prefix"`
	PoolSize int    `toml:"pool_size"`
	// AllowRanges are IPv4 CIDRs inside the infrastructure ranges (private, link-local,
	// CGNAT...) that sandboxes may reach anyway.
	AllowRanges []string `toml:"allow_ranges"`
	// DNS are the sandboxes' nameservers (IPv4); empty: the host's /etc/resolv.conf
	// unless it names a loopback nameserver.
	DNS []string `toml:"dns"`
	// EgressUpstreamCA is a PEM file of CA certificates the egress proxy trusts, besides
	// the system roots, for the servers of the HTTPS connections it terminates (those to
	// domains with network.rules): a private CA, or a test's.
	EgressUpstreamCA string `toml:"egress_upstream_ca"`
}

// Volumes configures the node's persistent volumes (E2B's Volume API).
type Volumes struct {
	// SizeMB is the size quota of each volume made from now on: its own loop-mounted ext4
	// filesystem of that size (at least 16). 0: no quota, a directory on the data dir's
	// filesystem.
	SizeMB int `toml:"size_mb"`
}

// Templates configures the built-in templates.
type Templates struct {
	// BaseRootFS is a prebuilt Debian base (`aenv template build-base`) installed as the
	// base template; empty: the node builds it with debootstrap in the background.
	BaseRootFS string `toml:"base_rootfs"`
	// BaseMirror and BaseSuite are the Debian archive and release the node's own build
	// uses (empty: the host's apt mirror, else deb.debian.org; bookworm).
	BaseMirror string `toml:"base_mirror"`
	BaseSuite  string `toml:"base_suite"`
	// LayeredBase makes the base template a layered (block) image, so its sandboxes can
	// snapshot, fork and pause to disk. Off: a directory template (overlayfs roots).
	LayeredBase bool `toml:"layered_base"`
}

// Cluster joins the node to a cluster (docs/cluster.md). Scheduler empty: a lone node.
type Cluster struct {
	// Scheduler is the scheduler's gRPC address (host:port).
	Scheduler string `toml:"scheduler"`
	// NodeID names the node in the cluster. Empty: the host name.
	NodeID string `toml:"node_id"`
	// Advertise is the API URL gateways reach this node at. Empty: http:// + listen.
	Advertise string `toml:"advertise"`
	// CPUCount and MemoryMB are what the node offers to sandboxes (0: no limit); the
	// sandbox slots are sandbox.max_sandboxes.
	CPUCount int `toml:"cpu_count"`
	MemoryMB int `toml:"memory_mb"`
	// P2P distributes sealed layers between the cluster's nodes.
	P2P P2P `toml:"p2p"`
}

// P2P serves the layers a node holds to its peers and reads lazily read layers from
// them first (docs/cluster.md). Off: nothing is served, asked or reported.
type P2P struct {
	Enabled bool `toml:"enabled"`
	// Listen is the peer listener (host:port), apart from the API; Advertise the URL
	// peers reach it at (empty: http:// + the bound listen address).
	Listen    string `toml:"listen"`
	Advertise string `toml:"advertise"`
	// Token is the cluster's peer secret (the same on every node, at least 16 bytes).
	Token string `toml:"token"`
	// UploadMiBps bounds what the node uploads to its peers (MiB/s, 0: no bound).
	UploadMiBps int `toml:"upload_mib_per_s"`
	// Parallel bounds the chunks one read fetches from peers at once.
	Parallel int `toml:"parallel"`
	// Timeout bounds one chunk's fetch from a peer before the repository is read.
	Timeout Duration `toml:"timeout"`
}

func (p P2P) validate(scheduler string, bad func(key, format string, args ...any)) {
	if p.Enabled && scheduler == "" {
		bad("cluster.p2p.enabled", "needs cluster.scheduler: peers are found through the scheduler")
	}
	if p.Listen != "" || p.Enabled {
		if h, port, err := net.SplitHostPort(p.Listen); err != nil || port == "" {
			bad("cluster.p2p.listen", "%q is not host:port", p.Listen)
		} else if ip := net.ParseIP(h); p.Advertise == "" && (h == "" || ip != nil && ip.IsUnspecified()) {
			bad("cluster.p2p.advertise", "must be set when cluster.p2p.listen (%q) is not one address peers can dial", p.Listen)
		}
	}
	if p.Advertise != "" {
		u, err := url.Parse(p.Advertise)
		if err != nil || (u.Scheme != "http" && u.Scheme != "https") || u.Host == "" || (u.Path != "" && u.Path != "/") {
			bad("cluster.p2p.advertise", "%q is not an http(s)://host:port URL", p.Advertise)
		}
	}
	if (p.Token != "" || p.Enabled) && len(p.Token) < 16 {
		bad("cluster.p2p.token", "must be at least 16 bytes, the same on every node")
	}
	if p.UploadMiBps < 0 || p.Parallel < 1 || p.Timeout.Duration <= 0 {
		bad("cluster.p2p", "upload_mib_per_s must not be negative, parallel must be at least 1 and timeout positive")
	}
}

func (cl Cluster) validate(bad func(key, format string, args ...any)) {
	if cl.Scheduler != "" {
		// Scheduler replicas: one host:port (a DNS name may resolve to all) or a list.
		for _, a := range strings.Split(cl.Scheduler, ",") {
			if h, p, err := net.SplitHostPort(strings.TrimSpace(a)); err != nil || h == "" || p == "" {
				bad("cluster.scheduler", "%q is not host:port or a comma-separated list of them (e.g. 10.0.0.5:9090)", cl.Scheduler)
				break
			}
		}
	}
	if cl.NodeID != "" && !nodeIDPattern.MatchString(cl.NodeID) {
		bad("cluster.node_id", "%q must be 1-63 letters, digits, '-', '_' or '.'", cl.NodeID)
	}
	if cl.Advertise != "" {
		u, err := url.Parse(cl.Advertise)
		if err != nil || (u.Scheme != "http" && u.Scheme != "https") || u.Host == "" || (u.Path != "" && u.Path != "/") {
			bad("cluster.advertise", "%q is not an http(s)://host:port URL", cl.Advertise)
		}
	}
	if cl.CPUCount < 0 || cl.MemoryMB < 0 {
		bad("cluster", "cpu_count and memory_mb must not be negative")
	}
	cl.P2P.validate(cl.Scheduler, bad)
}

var nodeIDPattern = regexp.MustCompile(`^[A-Za-z0-9][A-Za-z0-9._-]{0,62}$`)

// Proxy configures sandbox traffic routing.
type Proxy struct {
	Domains []string `toml:"domains"`
}

// Snapshot configures snapshot publication, catalog sync and lineage.
type Snapshot struct {
	// RepositoryBackend is where templates and snapshots are published: posix_fs or s3.
	RepositoryBackend string `toml:"repository_backend"`
	// MaxDepth is the layer count above which a snapshot's stack is merged.
	MaxDepth int `toml:"max_depth"`
	// PublishWorkers bounds concurrent blob uploads.
	PublishWorkers int      `toml:"publish_workers"`
	SyncInterval   Duration `toml:"sync_interval"`
	// GCGrace keeps unreferenced blobs this long after their last put.
	GCGrace Duration `toml:"gc_grace"`
	// Quiesce trades the sandbox's write stall during a snapshot against the image's
	// cleanliness: "freeze" (fsfreeze, a clean image, writes blocked for a few ms) or
	// "sync" (syncfs then seal, about a ms, a crash-consistent image whose journal
	// replays at the next mount).
	Quiesce string `toml:"quiesce"`
	// LazyLayers registers templates and snapshots synced from the repository without
	// downloading their layers: sandboxes read the blocks they touch, through the block
	// cache. False fetches every layer whole before the entry appears.
	LazyLayers bool `toml:"lazy_layers"`
}

// Repository locates the shared repository and the node-local cache in front of it.
type Repository struct {
	PosixFS RepositoryPosixFS `toml:"posix_fs"`
	S3      RepositoryS3      `toml:"s3"`
	Cache   RepositoryCache   `toml:"cache"`
	// BlockCache holds the blocks of layers read lazily from the repository.
	BlockCache RepositoryBlockCache `toml:"block_cache"`
}

// RepositoryBlockCache is the node-local cache of blocks of lazily read layers.
type RepositoryBlockCache struct {
	Dir         string `toml:"dir"` // empty: <data_dir>/block-cache
	MaxSizeGB   int    `toml:"max_size_gb"`
	BlockSizeKB int    `toml:"block_size_kb"`
	// Readahead is how many blocks past a sequential read are fetched in the background.
	Readahead     int     `toml:"readahead"`
	HighWatermark float64 `toml:"high_watermark"`
	LowWatermark  float64 `toml:"low_watermark"`
}

// RepositoryPosixFS is a repository on a (possibly shared) directory.
type RepositoryPosixFS struct {
	Path string `toml:"path"` // empty: <data_dir>/repository
}

// RepositoryS3 is a repository in an S3-compatible bucket.
type RepositoryS3 struct {
	Endpoint   string `toml:"endpoint"`
	Bucket     string `toml:"bucket"`
	Prefix     string `toml:"prefix"`
	Region     string `toml:"region"`
	Addressing string `toml:"addressing"`
	// AccessKey and SecretKey are static credentials; empty: AWS_* / MINIO_* environment
	// variables or the AWS shared credentials file.
	AccessKey string `toml:"access_key"`
	SecretKey string `toml:"secret_key"`
}

// RepositoryCache is the node-local blob cache.
type RepositoryCache struct {
	Dir           string  `toml:"dir"` // empty: <data_dir>/repository-cache
	MaxSizeGB     int     `toml:"max_size_gb"`
	HighWatermark float64 `toml:"high_watermark"`
	LowWatermark  float64 `toml:"low_watermark"`
}

// RepositoryPath is the posix_fs repository directory with its default applied.
func (c *Config) RepositoryPath() string {
	if c.Repository.PosixFS.Path != "" {
		return c.Repository.PosixFS.Path
	}
	return filepath.Join(c.DataDir, "repository")
}

// RepositoryCacheDir is the node cache directory with its default applied.
func (c *Config) RepositoryCacheDir() string {
	if c.Repository.Cache.Dir != "" {
		return c.Repository.Cache.Dir
	}
	return filepath.Join(c.DataDir, "repository-cache")
}

// BlockCacheDir is the block cache directory with its default applied.
func (c *Config) BlockCacheDir() string {
	if c.Repository.BlockCache.Dir != "" {
		return c.Repository.BlockCache.Dir
	}
	return filepath.Join(c.DataDir, "block-cache")
}

// Duration is a time.Duration written as a Go duration string ("300s", "24h").
type Duration struct{ time.Duration }

// UnmarshalText parses a Go duration string.
func (d *Duration) UnmarshalText(b []byte) error {
	v, err := time.ParseDuration(strings.TrimSpace(string(b)))
	if err != nil {
		return fmt.Errorf("%q is not a duration like \"300s\" or \"24h\"", string(b))
	}
	d.Duration = v
	return nil
}

// MarshalText writes the duration string.
func (d Duration) MarshalText() ([]byte, error) { return []byte(d.String()), nil }

// Default returns the embedded defaults.
func Default() Config {
	var c Config
	if _, err := toml.Decode(defaultTOML, &c); err != nil {
		panic("config: embedded default.toml is invalid: " + err.Error()) // a build defect
	}
	return c
}

// Load returns the defaults overridden by the TOML file at path (if path is not empty) and
// by AENV_* variables from lookupEnv (os.LookupEnv in production). Unknown keys in the file,
// malformed values and invalid settings are errors that name the key.
func Load(path string, lookupEnv func(string) (string, bool)) (Config, error) {
	c := Default()
	if path != "" {
		md, err := toml.DecodeFile(path, &c)
		if err != nil {
			return c, fmt.Errorf("config %s: %w", path, err)
		}
		if und := md.Undecoded(); len(und) > 0 {
			keys := make([]string, len(und))
			for i, k := range und {
				keys[i] = k.String()
			}
			return c, fmt.Errorf("config %s: unknown keys: %s (see docs/configuration.md)", path, strings.Join(keys, ", "))
		}
	}
	if lookupEnv != nil {
		if err := applyEnv(reflect.ValueOf(&c).Elem(), "AENV", lookupEnv); err != nil {
			return c, err
		}
	}
	if err := c.Validate(); err != nil {
		return c, err
	}
	return c, nil
}

// EnvVars lists every environment variable Load reads, in field order (for docs and help).
func EnvVars() []string {
	var out []string
	var walk func(t reflect.Type, prefix string)
	walk = func(t reflect.Type, prefix string) {
		for i := range t.NumField() {
			f := t.Field(i)
			name := prefix + "_" + strings.ToUpper(f.Tag.Get("toml"))
			if f.Type.Kind() == reflect.Struct && f.Type != reflect.TypeFor[Duration]() {
				walk(f.Type, name)
				continue
			}
			out = append(out, name)
		}
	}
	walk(reflect.TypeFor[Config](), "AENV")
	return out
}

var textUnmarshalerType = reflect.TypeFor[interface{ UnmarshalText([]byte) error }]()

func applyEnv(v reflect.Value, prefix string, lookupEnv func(string) (string, bool)) error {
	t := v.Type()
	for i := range t.NumField() {
		f := t.Field(i)
		fv := v.Field(i)
		name := prefix + "_" + strings.ToUpper(f.Tag.Get("toml"))
		if fv.Kind() == reflect.Struct && !reflect.PointerTo(f.Type).Implements(textUnmarshalerType) {
			if err := applyEnv(fv, name, lookupEnv); err != nil {
				return err
			}
			continue
		}
		raw, ok := lookupEnv(name)
		if !ok {
			continue
		}
		if err := setFromString(fv, raw); err != nil {
			return fmt.Errorf("environment variable %s: %w", name, err)
		}
	}
	return nil
}

func setFromString(fv reflect.Value, raw string) error {
	if u, ok := fv.Addr().Interface().(interface{ UnmarshalText([]byte) error }); ok {
		return u.UnmarshalText([]byte(raw))
	}
	switch fv.Kind() {
	case reflect.String:
		fv.SetString(raw)
	case reflect.Int:
		n, err := strconv.Atoi(strings.TrimSpace(raw))
		if err != nil {
			return fmt.Errorf("%q is not an integer", raw)
		}
		fv.SetInt(int64(n))
	case reflect.Float64:
		f, err := strconv.ParseFloat(strings.TrimSpace(raw), 64)
		if err != nil {
			return fmt.Errorf("%q is not a number", raw)
		}
		fv.SetFloat(f)
	case reflect.Bool:
		b, err := strconv.ParseBool(strings.TrimSpace(raw))
		if err != nil {
			return fmt.Errorf("%q is not true or false", raw)
		}
		fv.SetBool(b)
	case reflect.Slice:
		var items []string
		for _, s := range strings.Split(raw, ",") {
			if s = strings.TrimSpace(s); s != "" {
				items = append(items, s)
			}
		}
		fv.Set(reflect.ValueOf(items))
	default:
		return fmt.Errorf("unsupported setting type %s", fv.Type())
	}
	return nil
}

// Validate checks every setting and names the key of the first bad one.
func (c *Config) Validate() error {
	var errs []error
	bad := func(key, format string, args ...any) {
		errs = append(errs, fmt.Errorf("%s: %s", key, fmt.Sprintf(format, args...)))
	}
	if _, _, err := net.SplitHostPort(c.Listen); err != nil {
		bad("listen", "%q is not host:port (e.g. 127.0.0.1:8000)", c.Listen)
	}
	if c.Volumes.SizeMB != 0 && c.Volumes.SizeMB < 16 {
		bad("volumes.size_mb", "%d is below the minimum of 16 (0: no quota)", c.Volumes.SizeMB)
	}
	if c.MetricsListen != "" {
		if _, _, err := net.SplitHostPort(c.MetricsListen); err != nil {
			bad("metrics_listen", "%q is not host:port (e.g. 127.0.0.1:9100)", c.MetricsListen)
		}
	}
	if c.DebugListen != "" {
		if _, _, err := net.SplitHostPort(c.DebugListen); err != nil {
			bad("debug_listen", "%q is not host:port (e.g. 127.0.0.1:6060)", c.DebugListen)
		}
	}
	if c.DataDir == "" {
		bad("data_dir", "must not be empty")
	} else if !filepath.IsAbs(c.DataDir) {
		abs, err := filepath.Abs(c.DataDir)
		if err != nil {
			bad("data_dir", "%v", err)
		}
		c.DataDir = abs
	}
	if c.APIKey != "" && len(c.APIKey) < 16 {
		bad("api_key", "must be at least 16 characters")
	}
	switch c.LogLevel {
	case "debug", "info", "warn", "error":
	default:
		bad("log_level", "%q is not one of debug, info, warn, error", c.LogLevel)
	}
	switch c.LogFormat {
	case "text", "json":
	default:
		bad("log_format", "%q is not text or json", c.LogFormat)
	}
	s := c.Sandbox
	for key, d := range map[string]time.Duration{
		"sandbox.default_timeout": s.DefaultTimeout.Duration, "sandbox.default_timeout_v1": s.DefaultTimeoutV1.Duration,
		"sandbox.max_timeout": s.MaxTimeout.Duration, "envd.ready_timeout": c.Envd.ReadyTimeout.Duration,
	} {
		if d <= 0 {
			bad(key, "must be positive, got %s", d)
		}
	}
	if c.Backend.CgroupParent == "" || strings.Contains(c.Backend.CgroupParent, "..") || strings.HasPrefix(c.Backend.CgroupParent, "/") {
		bad("backend.cgroup_parent", "%q must be a relative cgroup path such as \"aenv\"", c.Backend.CgroupParent)
	}
	if c.Backend.UIDBase != 0 && (c.Backend.UIDBase < 100000 || c.Backend.UIDBase > 1<<32-1<<16) {
		bad("backend.uid_base", "%d must be 0 (automatic) or a host uid from 100000 to %d", c.Backend.UIDBase, 1<<32-1<<16)
	}
	if c.Backend.UIDRanges < 0 || c.Backend.UIDRanges > 65000 {
		bad("backend.uid_ranges", "must be 0 (automatic) or between 1 and 65000, got %d", c.Backend.UIDRanges)
	}
	if _, err := netip.ParsePrefix(c.Network.Subnet); err != nil {
		bad("network.subnet", "%q is not a CIDR prefix such as 10.88.0.0/16", c.Network.Subnet)
	}
	if c.Network.Bridge == "" || c.Network.Prefix == "" {
		bad("network", "bridge and prefix must not be empty")
	}
	c.Cluster.validate(bad)
	for _, r := range c.Network.AllowRanges {
		if p, err := netip.ParsePrefix(r); err != nil || !p.Addr().Is4() {
			bad("network.allow_ranges", "%q is not an IPv4 CIDR prefix such as 10.20.0.0/16", r)
		}
	}
	for _, a := range c.Network.DNS {
		if ip, err := netip.ParseAddr(a); err != nil || !ip.Is4() {
			bad("network.dns", "%q is not an IPv4 address", a)
		}
	}
	if c.Network.PoolSize < 0 {
		bad("network.pool_size", "must not be negative, got %d", c.Network.PoolSize)
	}
	if s.DefaultTimeout.Duration > s.MaxTimeout.Duration {
		bad("sandbox.default_timeout", "%s exceeds sandbox.max_timeout %s", s.DefaultTimeout, s.MaxTimeout)
	}
	if s.DefaultCPU < 1 {
		bad("sandbox.default_cpu", "must be at least 1, got %d", s.DefaultCPU)
	}
	if s.DefaultMemoryMB < 64 {
		bad("sandbox.default_memory_mb", "must be at least 64, got %d", s.DefaultMemoryMB)
	}
	if s.DefaultDiskMB < 0 {
		bad("sandbox.default_disk_mb", "must not be negative, got %d", s.DefaultDiskMB)
	}
	if s.MaxSandboxes < 0 {
		bad("sandbox.max_sandboxes", "must not be negative, got %d", s.MaxSandboxes)
	}
	if s.CPUOvercommit < 0 || s.CPUOvercommit > 1000 {
		bad("sandbox.cpu_overcommit", "must be between 0 (no limit) and 1000, got %g", s.CPUOvercommit)
	}
	if s.MemoryOvercommit < 0 || s.MemoryOvercommit > 1000 {
		bad("sandbox.memory_overcommit", "must be between 0 (no limit) and 1000, got %g", s.MemoryOvercommit)
	}
	switch s.ShutdownAction {
	case "pause", "stop", "keep":
	default:
		bad("sandbox.shutdown_action", "%q is not pause, stop or keep", s.ShutdownAction)
	}
	if !semver(c.Envd.Version) {
		bad("envd.version", "%q is not a dotted version like 0.5.15 (the SDKs compare it)", c.Envd.Version)
	}
	switch c.Backend.Kind {
	case "oci":
	case "microvm":
		if !c.Templates.LayeredBase {
			bad("templates.layered_base", "must be true with backend.kind = \"microvm\" (a VM boots layered templates only)")
		}
	default:
		bad("backend.kind", "%q is not supported; use oci or microvm", c.Backend.Kind)
	}
	switch c.Backend.Accel {
	case "auto", "tcg", "kvm":
	default:
		bad("backend.accel", "%q is not auto, tcg or kvm", c.Backend.Accel)
	}
	if c.Backend.WarmContainers < 0 || c.Backend.WarmContainers > 256 {
		bad("backend.warm_containers", "%d is not 0 (none) or 1..256", c.Backend.WarmContainers)
	}
	if c.Backend.WarmContainersMax < c.Backend.WarmContainers || c.Backend.WarmContainersMax > 256 {
		bad("backend.warm_containers_max", "%d is not between backend.warm_containers (%d) and 256",
			c.Backend.WarmContainersMax, c.Backend.WarmContainers)
	}
	if c.Backend.SnapshotPool < 0 || c.Backend.SnapshotPool > 64 {
		bad("backend.snapshot_pool", "%d is not 0 (no pool) or 1..64", c.Backend.SnapshotPool)
	}
	if c.Backend.SnapshotPoolMax < 0 || c.Backend.SnapshotPoolMax > 1024 {
		bad("backend.snapshot_pool_max", "%d is not 0 (4 × snapshot_pool) or 1..1024", c.Backend.SnapshotPoolMax)
	}
	if c.Backend.TBSizeMiB < 0 || c.Backend.TBSizeMiB > 4096 {
		bad("backend.tb_size_mib", "%d is not 0 (QEMU's default) or 1..4096", c.Backend.TBSizeMiB)
	}
	switch c.Backend.Runtime {
	case "auto", "runc", "crun", "runsc":
	default:
		// A runtime outside PATH (a newer build beside the distribution's); the backend's
		// probe says whether it runs.
		if !filepath.IsAbs(c.Backend.Runtime) {
			bad("backend.runtime", "%q is not auto, runc, crun, runsc or an absolute path to one of them", c.Backend.Runtime)
		}
	}
	for _, d := range c.Proxy.Domains {
		if d == "" || strings.ContainsAny(d, "/ ") {
			bad("proxy.domains", "%q is not a domain", d)
		}
	}
	c.validateRepository(bad)
	return errors.Join(errs...)
}

func semver(v string) bool {
	parts := strings.Split(v, ".")
	if len(parts) != 3 {
		return false
	}
	for _, p := range parts {
		if _, err := strconv.ParseUint(p, 10, 32); err != nil {
			return false
		}
	}
	return true
}
