package microvm

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"os"
	"strconv"
	"strings"
	"time"

	"golang.org/x/sys/unix"

	"github.com/aenv-dev/aenv/internal/vmm"
)

// vmSpec is one QEMU microvm.
type vmSpec struct {
	qemu    string
	accel   string // "tcg" or "kvm"
	kernel  string
	initrd  string
	cmdline string
	cpus    int
	memMB   int
	ramFile string // guest RAM (memory-backend-file id=mem), on tmpfs
	// privateRAM maps ramFile copy-on-write (share=off): a restore on a memory image that
	// other sandboxes share. Otherwise the file is the guest's memory (share=on).
	privateRAM bool
	disk       string // raw root disk (virtio-blk)
	nic        *guestNIC
	pidFile    string
	qmp        string // QMP unix socket
	console    string // serial console log
}

// config is the VMM configuration. Device order is fixed (disk, then NIC): a migration
// stream only loads into a VM with the same devices in the same order.
func (s vmSpec) config() vmm.Config {
	c := vmm.Config{
		Binary: s.qemu, Accel: vmm.Accel(s.accel), CPUs: s.cpus,
		Memory: vmm.Memory{SizeMiB: s.memMB, Path: s.ramFile, Share: !s.privateRAM},
		Kernel: s.kernel, Initrd: s.initrd, Cmdline: s.cmdline,
		ConsoleLog: s.console, QMPSocket: s.qmp, PIDFile: s.pidFile,
		Drives: []vmm.Drive{{ID: "root", Path: s.disk}},
	}
	if s.nic != nil {
		c.NICs = []vmm.NIC{{ID: "n0", TapFile: s.nic.tap, MAC: s.nic.mac.String()}}
	}
	return c
}

// vmProc is a running QEMU started by this process.
type vmProc struct {
	pid  int
	m    *vmm.Machine
	done <-chan struct{} // closed when the process has exited and been reaped
}

// startVM boots QEMU (in a session of its own: it outlives this process if the node dies;
// Reconcile finds it by its pidfile) and returns once its monitor answers. With state it
// instead loads that snapshot and leaves the guest paused.
func startVM(ctx context.Context, s vmSpec, state *vmm.State) (*vmProc, error) {
	var m *vmm.Machine
	var err error
	if state != nil {
		m, err = vmm.RestorePaused(ctx, s.config(), *state)
	} else {
		m, err = vmm.Start(ctx, s.config())
	}
	if err != nil {
		return nil, fmt.Errorf("microvm: %w", err)
	}
	return &vmProc{pid: m.PID(), m: m, done: m.Exited()}, nil
}

// exited reports whether the process has ended.
func (p *vmProc) exited() bool {
	select {
	case <-p.done:
		return true
	default:
		return false
	}
}

// kill ends the process and waits until it is reaped.
func (p *vmProc) kill(ctx context.Context) error {
	if p.exited() {
		return nil
	}
	done := make(chan struct{})
	go func() { p.m.Kill(); close(done) }()
	select {
	case <-done:
		return nil
	case <-ctx.Done():
		return fmt.Errorf("microvm: qemu %d did not exit: %w", p.pid, ctx.Err())
	case <-time.After(30 * time.Second):
		return fmt.Errorf("microvm: qemu %d did not exit 30 s after SIGKILL", p.pid)
	}
}

// qemuPID returns the pid in pidFile when that process is still a QEMU started with this
// pidfile (a recycled pid never is).
func qemuPID(pidFile string) (int, bool) {
	raw, err := os.ReadFile(pidFile)
	if err != nil {
		return 0, false
	}
	pid, err := strconv.Atoi(strings.TrimSpace(string(raw)))
	if err != nil || pid <= 0 {
		return 0, false
	}
	cmdline, err := os.ReadFile("/proc/" + strconv.Itoa(pid) + "/cmdline")
	if err != nil {
		return 0, false
	}
	for _, arg := range bytes.Split(cmdline, []byte{0}) {
		if string(arg) == pidFile {
			return pid, true
		}
	}
	return 0, false
}

// killOrphan kills a QEMU that is not this process's child (left by a crashed node) and
// waits until it is gone. It may be stuck on a disk whose FUSE server died: the SIGKILL
// takes effect once the connection is aborted, so call this before the sweep and wait
// after it (waitGone).
func killOrphan(pid int) error {
	if err := unix.Kill(pid, unix.SIGKILL); err != nil && !errors.Is(err, unix.ESRCH) {
		return fmt.Errorf("microvm: kill qemu %d: %w", pid, err)
	}
	return nil
}

// waitGone waits until pid no longer exists (or is a zombie of another parent).
func waitGone(ctx context.Context, pid int) error {
	deadline := time.Now().Add(30 * time.Second)
	for {
		st, err := os.ReadFile("/proc/" + strconv.Itoa(pid) + "/stat")
		if err != nil {
			return nil
		}
		// The state follows the command name in parentheses.
		if i := bytes.LastIndexByte(st, ')'); i > 0 && i+2 < len(st) && st[i+2] == 'Z' {
			return nil
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("microvm: qemu %d still exists 30 s after SIGKILL", pid)
		}
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(10 * time.Millisecond):
		}
	}
}
