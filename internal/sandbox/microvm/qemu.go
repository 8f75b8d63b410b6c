package microvm

import (
	"context"
	"fmt"
	"time"

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
	log        string // QEMU's own output
	tscKHz     int    // TCG: the host TSC rate (tsc_early_khz)
	tbSizeMiB  int    // TCG: translation cache cap (0: QEMU's default)
	confine    *vmm.Confinement
}

// config is the VMM configuration. Device order is fixed (disk, then NIC): a migration
// stream only loads into a VM with the same devices in the same order.
func (s vmSpec) config() vmm.Config {
	c := vmm.Config{
		Binary: s.qemu, Accel: vmm.Accel(s.accel), CPUs: s.cpus,
		Memory: vmm.Memory{SizeMiB: s.memMB, Path: s.ramFile, Share: !s.privateRAM},
		Kernel: s.kernel, Initrd: s.initrd, Cmdline: s.cmdline,
		ConsoleLog: s.console, QMPSocket: s.qmp, PIDFile: s.pidFile, LogFile: s.log, TSCKHz: s.tscKHz, TBSizeMiB: s.tbSizeMiB,
		Drives: []vmm.Drive{{ID: "root", Path: s.disk}}, Confine: s.confine,
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
