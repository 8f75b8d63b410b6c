package microvm

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"strconv"
	"strings"
	"syscall"
	"time"

	"golang.org/x/sys/unix"
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
	ramFile string // guest RAM (memory-backend-file id=mem, share=on), on tmpfs
	disk    string // raw root disk (virtio-blk)
	nic     *guestNIC
	pidFile string
	qmp     string // QMP unix socket
	console string // serial console log
}

// args is QEMU's command line. Device order is fixed (disk, then NIC): a migration stream
// only loads into a VM with the same devices in the same order.
func (s vmSpec) args() []string {
	mem := strconv.Itoa(s.memMB) + "M"
	a := []string{
		"-M", "microvm,memory-backend=mem", "-accel", s.accel, "-cpu", "max",
		"-smp", strconv.Itoa(s.cpus), "-m", mem,
		"-nodefaults", "-no-user-config", "-display", "none", "-no-reboot",
		"-object", "memory-backend-file,id=mem,size=" + mem + ",mem-path=" + s.ramFile + ",share=on",
		"-kernel", s.kernel, "-initrd", s.initrd, "-append", s.cmdline,
		"-serial", "file:" + s.console,
		"-qmp", "unix:" + s.qmp + ",server=on,wait=off",
		"-pidfile", s.pidFile,
		"-drive", "id=root,file=" + s.disk + ",format=raw,if=none,cache=writeback,aio=threads",
		"-device", "virtio-blk-device,drive=root",
	}
	if s.nic != nil {
		// fd 3 is the first of ExtraFiles.
		a = append(a, "-netdev", "tap,id=n0,fd=3,vhost=off",
			"-device", "virtio-net-device,netdev=n0,mac="+s.nic.mac.String())
	}
	return a
}

// vmProc is a running QEMU started by this process.
type vmProc struct {
	pid  int
	done chan struct{} // closed when the process has exited and been reaped
	err  error         // exit status, valid after done
}

// startVM starts QEMU in its own session (it outlives this process if the node dies;
// Reconcile finds it by its pidfile) and returns once it runs.
func startVM(s vmSpec) (*vmProc, error) {
	cmd := exec.Command(s.qemu, s.args()...)
	cmd.SysProcAttr = &syscall.SysProcAttr{Setsid: true}
	if s.nic != nil {
		cmd.ExtraFiles = []*os.File{s.nic.tap}
	}
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	if err := cmd.Start(); err != nil {
		return nil, fmt.Errorf("microvm: start qemu: %w", err)
	}
	p := &vmProc{pid: cmd.Process.Pid, done: make(chan struct{})}
	go func() {
		err := cmd.Wait()
		if err != nil && stderr.Len() > 0 {
			err = fmt.Errorf("%w: %s", err, strings.TrimSpace(stderr.String()))
		}
		p.err = err
		close(p.done)
	}()
	return p, nil
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
	if err := unix.Kill(p.pid, unix.SIGKILL); err != nil && !errors.Is(err, unix.ESRCH) {
		return fmt.Errorf("microvm: kill qemu %d: %w", p.pid, err)
	}
	select {
	case <-p.done:
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
