package oci

import (
	"os"
	"path/filepath"
	"strconv"

	"golang.org/x/sys/unix"

	specs "github.com/opencontainers/runtime-spec/specs-go"
)

// specParams is everything that varies between sandbox configs.
type specParams struct {
	rootfs      string
	hostname    string
	netnsPath   string // "" = a fresh, empty network namespace (probe)
	envdPath    string // host path bind-mounted read-only at envdMount
	args        []string
	env         []string
	cgroupsPath string
	cpuCount    int
	memoryMB    int
	pidsLimit   int64
	idmap       *idMap // nil = no user namespace
	memsw       bool   // the host accounts swap (v1 memory.memsw.*): pin swap to the limit
	resolvConf  string // host file bind-mounted at /etc/resolv.conf; "" = none
	volumes     []specs.Mount
	// emptyDir is a host directory, empty and read-only, bound over the masked
	// directories maskDirs instead of a tmpfs each (see hostMaskedDirs); "" = tmpfs.
	emptyDir string
	maskDirs []string
	// cgroupBinds are the host's v1 hierarchies (mount points) the sandbox's
	// /sys/fs/cgroup shows, each as a read-only bind of the sandbox's own cgroup there;
	// nil: a cgroup mount, which the runtime fills. For crun (runtimeCLI.cgroupView),
	// whose cgroup mount holds every hierarchy of /proc/self/cgroup, not only those the
	// sandbox is in.
	cgroupBinds []string
	// cgroupViewDir is the host directory (makeCgroupViewDir) holding the binds' mount
	// points, bound read-only at /sys/fs/cgroup; "": a tmpfs there.
	cgroupViewDir string
}

// cgroupMounts are the mounts of the sandbox's /sys/fs/cgroup.
func (p specParams) cgroupMounts() []specs.Mount {
	ro := []string{"nosuid", "noexec", "nodev", "relatime", "ro"}
	if len(p.cgroupBinds) == 0 {
		return []specs.Mount{{Destination: cgroupRoot, Type: "cgroup", Source: "cgroup", Options: ro}}
	}
	root := specs.Mount{Destination: cgroupRoot, Type: "none", Source: p.cgroupViewDir, Options: append([]string{"bind"}, ro...)}
	if p.cgroupViewDir == "" {
		// Writable, as it must be for the runtime to make the mount points below it,
		// but with room for no more than a few empty files.
		root = specs.Mount{Destination: cgroupRoot, Type: "tmpfs", Source: "tmpfs",
			Options: []string{"nosuid", "noexec", "nodev", "mode=755", "size=4k", "nr_inodes=" + strconv.Itoa(len(p.cgroupBinds)+8)}}
	}
	ms := []specs.Mount{root}
	for _, h := range p.cgroupBinds {
		ms = append(ms, specs.Mount{Destination: filepath.Join(cgroupRoot, filepath.Base(h)), Type: "none",
			Source: filepath.Join(h, p.cgroupsPath), Options: append([]string{"rbind"}, ro...)})
	}
	return ms
}

// envdMount is where the host's envd appears inside every sandbox.
const envdMount = "/.aenv/envd"

// specVersion is the ociVersion of our config.json: the oldest runtime-spec release whose
// fields it uses (all from 1.0). Not the Go module's specs.Version (1.2.0), which Debian
// 12's crun 1.8.1 refuses ("unknown version specified"); runc and runsc take either.
const specVersion = "1.0.2"

// capabilities is Docker's default set minus NET_RAW (raw sockets spoof and sniff on the
// bridge) and MKNOD (device nodes); enough for envd to switch to the sandbox user and for
// package managers to chown files.
var capabilities = []string{
	"CAP_CHOWN", "CAP_DAC_OVERRIDE", "CAP_FSETID", "CAP_FOWNER", "CAP_SETGID", "CAP_SETUID",
	"CAP_SETFCAP", "CAP_SETPCAP", "CAP_NET_BIND_SERVICE", "CAP_SYS_CHROOT", "CAP_KILL",
	"CAP_AUDIT_WRITE",
}

var maskedPaths = []string{
	"/proc/acpi", "/proc/asound", "/proc/kcore", "/proc/keys", "/proc/latency_stats",
	"/proc/timer_list", "/proc/timer_stats", "/proc/sched_debug", "/proc/scsi",
	"/sys/firmware", "/sys/devices/virtual/powercap",
}

var readonlyPaths = []string{
	"/proc/bus", "/proc/fs", "/proc/irq", "/proc/sys", "/proc/sysrq-trigger",
}

func buildSpec(p specParams) *specs.Spec {
	ns := []specs.LinuxNamespace{
		{Type: specs.PIDNamespace}, {Type: specs.IPCNamespace}, {Type: specs.UTSNamespace},
		{Type: specs.MountNamespace}, {Type: specs.CgroupNamespace},
		{Type: specs.NetworkNamespace, Path: p.netnsPath},
	}
	sysMount := specs.Mount{Destination: "/sys", Type: "sysfs", Source: "sysfs", Options: []string{"nosuid", "noexec", "nodev", "ro"}}
	var uidMaps, gidMaps []specs.LinuxIDMapping
	if p.idmap != nil {
		ns = append(ns, specs.LinuxNamespace{Type: specs.UserNamespace})
		uidMaps = []specs.LinuxIDMapping{{ContainerID: 0, HostID: p.idmap.HostID, Size: p.idmap.Size}}
		gidMaps = uidMaps
		// sysfs cannot be mounted from a user namespace into a network namespace it does not
		// own (ours is made by the host), so bind the host's read-only instead, as rootless
		// runtimes do; masked paths still apply.
		sysMount = specs.Mount{Destination: "/sys", Type: "none", Source: "/sys", Options: []string{"rbind", "nosuid", "noexec", "nodev", "ro"}}
	}
	caps := append([]string(nil), capabilities...)
	cpu := &specs.LinuxCPU{}
	if p.cpuCount > 0 {
		quota, period := int64(p.cpuCount)*100000, uint64(100000)
		cpu.Quota, cpu.Period = &quota, &period
	}
	mem := &specs.LinuxMemory{}
	if p.memoryMB > 0 {
		limit := int64(p.memoryMB) << 20
		mem.Limit = &limit
		if p.memsw {
			mem.Swap = &limit
		}
	}
	pids := &specs.LinuxPids{Limit: p.pidsLimit}
	noFile := nofileLimit()
	mounts := []specs.Mount{
		{Destination: "/proc", Type: "proc", Source: "proc", Options: []string{"nosuid", "noexec", "nodev"}},
		{Destination: "/dev", Type: "tmpfs", Source: "tmpfs", Options: []string{"nosuid", "strictatime", "mode=755", "size=65536k"}},
		{Destination: "/dev/pts", Type: "devpts", Source: "devpts", Options: []string{"nosuid", "noexec", "newinstance", "ptmxmode=0666", "mode=0620", "gid=5"}},
		{Destination: "/dev/shm", Type: "tmpfs", Source: "shm", Options: []string{"nosuid", "noexec", "nodev", "mode=1777", "size=65536k"}},
		{Destination: "/dev/mqueue", Type: "mqueue", Source: "mqueue", Options: []string{"nosuid", "noexec", "nodev"}},
		sysMount,
	}
	mounts = append(mounts, p.cgroupMounts()...)
	mounts = append(mounts, specs.Mount{Destination: envdMount, Type: "none", Source: p.envdPath, Options: []string{"bind", "ro", "nosuid", "nodev"}})
	masked, maskMounts := maskBinds(maskedPaths, p.maskDirs, p.emptyDir)
	mounts = append(mounts, maskMounts...)
	if p.resolvConf != "" {
		mounts = append(mounts, specs.Mount{Destination: "/etc/resolv.conf", Type: "none", Source: p.resolvConf,
			Options: []string{"bind", "ro", "nosuid", "nodev", "noexec"}})
	}
	mounts = append(mounts, p.volumes...)
	return &specs.Spec{
		Version:  specVersion,
		Hostname: p.hostname,
		Root:     &specs.Root{Path: p.rootfs},
		Process: &specs.Process{
			User: specs.User{UID: 0, GID: 0},
			Args: p.args,
			Env:  p.env,
			Cwd:  "/",
			Capabilities: &specs.LinuxCapabilities{
				Bounding: caps, Effective: caps, Permitted: caps,
			},
			Rlimits:     []specs.POSIXRlimit{{Type: "RLIMIT_NOFILE", Hard: noFile, Soft: noFile}},
			OOMScoreAdj: new(sandboxOOMScoreAdj),
			// Setuid programs work (sudo in the base template, as on E2B; Docker's default
			// too): they reach the sandbox's root, with the capability set and seccomp
			// profile above, which envd gives any client asking for user "root" anyway.
			NoNewPrivileges: false,
		},
		Mounts: mounts,
		Linux: &specs.Linux{
			Namespaces:  ns,
			UIDMappings: uidMaps,
			GIDMappings: gidMaps,
			CgroupsPath: p.cgroupsPath,
			Resources: &specs.LinuxResources{
				Devices: []specs.LinuxDeviceCgroup{{Allow: false, Access: "rwm"}},
				CPU:     cpu,
				Memory:  mem,
				Pids:    pids,
			},
			Seccomp:           defaultSeccomp(),
			MaskedPaths:       masked,
			ReadonlyPaths:     readonlyPaths,
			RootfsPropagation: "private",
		},
	}
}

// sandboxOOMScoreAdj makes a sandbox's processes the host OOM killer's first choice over
// the node and the data plane: left at 0, the data plane (~1 MiB per disk, the largest
// process on a full node) is its pick, and every sandbox's root dies with it. Raising a
// score needs no privilege. Nothing in the sandbox can go below 0, the host processes'
// default (that needs CAP_SYS_RESOURCE on the host), nor below 500 where the runtime
// held CAP_SYS_RESOURCE when it set it (the kernel then records it as the floor).
const sandboxOOMScoreAdj = 500

// nofileLimit is 65536 open files, or less when our own hard limit is lower (the runtime
// cannot raise it without CAP_SYS_RESOURCE in the host's user namespace).
func nofileLimit() uint64 {
	var r unix.Rlimit
	if err := unix.Getrlimit(unix.RLIMIT_NOFILE, &r); err == nil && r.Max < 65536 {
		return r.Max
	}
	return 65536
}

// hostAccountsSwap reports whether cgroup v1 swap accounting is on (memsw files exist);
// without it runc fails when asked to set a swap limit.
func hostAccountsSwap(v2 bool) bool {
	if v2 {
		return false
	}
	_, err := os.Stat(cgroupRoot + "/memory/memory.memsw.limit_in_bytes")
	return err == nil
}
