package oci

import (
	specs "github.com/opencontainers/runtime-spec/specs-go"
	"golang.org/x/sys/unix"
)

// deniedSyscalls are refused with EPERM: what Docker's default profile withholds from a
// container without CAP_SYS_ADMIN and friends (kernel modules, kexec, mounts, keyrings,
// BPF, perf, clock and swap changes, NUMA policy, handle-based opens), plus io_uring, which
// bypasses seccomp for the operations it submits. A denylist keeps every new harmless
// syscall working, which matters for arbitrary agent workloads.
var deniedSyscalls = []string{
	"acct", "add_key", "bpf", "clock_adjtime", "clock_settime", "create_module",
	"delete_module", "finit_module", "fsconfig", "fsmount", "fsopen", "fspick",
	"get_kernel_syms", "get_mempolicy", "init_module", "io_uring_enter", "io_uring_register",
	"io_uring_setup", "ioperm", "iopl", "kcmp", "kexec_file_load", "kexec_load", "keyctl",
	"lookup_dcookie", "mbind", "mount", "mount_setattr", "move_mount", "move_pages",
	"name_to_handle_at", "nfsservctl", "open_by_handle_at", "open_tree", "perf_event_open",
	"pivot_root", "quotactl", "quotactl_fd", "reboot", "request_key", "set_mempolicy",
	"setns", "settimeofday", "stime", "swapoff", "swapon", "sysfs", "_sysctl", "syslog",
	"umount", "umount2", "unshare", "uselib", "userfaultfd", "ustat", "vm86", "vm86old",
	"fanotify_init", "lsm_set_self_attr", "adjtimex",
}

// namespaceFlags are clone flags that create namespaces; clone with any of them is refused,
// as Docker does, so a sandbox cannot nest user namespaces to reach more kernel surface.
var namespaceFlags = []uint64{
	unix.CLONE_NEWNS, unix.CLONE_NEWUTS, unix.CLONE_NEWIPC, unix.CLONE_NEWUSER,
	unix.CLONE_NEWPID, unix.CLONE_NEWNET, unix.CLONE_NEWCGROUP,
}

// defaultSeccomp is the sandbox's seccomp profile: allow by default, deny the above.
func defaultSeccomp() *specs.LinuxSeccomp {
	eperm := uint(unix.EPERM)
	enosys := uint(unix.ENOSYS)
	sc := &specs.LinuxSeccomp{
		DefaultAction: specs.ActAllow,
		Architectures: []specs.Arch{specs.ArchX86_64, specs.ArchX86, specs.ArchX32, specs.ArchAARCH64, specs.ArchARM},
		Syscalls: []specs.LinuxSyscall{
			{Names: deniedSyscalls, Action: specs.ActErrno, ErrnoRet: &eperm},
			// clone3 passes flags in memory seccomp cannot read: ENOSYS makes libc fall back
			// to clone, whose flags are checked below.
			{Names: []string{"clone3"}, Action: specs.ActErrno, ErrnoRet: &enosys},
		},
	}
	// AF_VSOCK reaches the hypervisor and other guests over the host's vsock device, which
	// network namespaces do not isolate; Docker's profile refuses it as well. (A 32-bit
	// x86 process creating sockets through socketcall(2) is not covered: seccomp cannot
	// read socketcall's arguments. docs/operations.md lists this.)
	sc.Syscalls = append(sc.Syscalls, specs.LinuxSyscall{
		Names: []string{"socket"}, Action: specs.ActErrno, ErrnoRet: &eperm,
		Args: []specs.LinuxSeccompArg{{Index: 0, Value: unix.AF_VSOCK, Op: specs.OpEqualTo}},
	})
	for _, f := range namespaceFlags {
		sc.Syscalls = append(sc.Syscalls, specs.LinuxSyscall{
			Names: []string{"clone"}, Action: specs.ActErrno, ErrnoRet: &eperm,
			Args: []specs.LinuxSeccompArg{{Index: 0, Value: f, ValueTwo: f, Op: specs.OpMaskedEqual}},
		})
	}
	return sc
}
