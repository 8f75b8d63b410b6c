package vmm

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"strconv"
	"strings"
	"syscall"
	"time"
)

// DefaultBinary is the QEMU executable used when Config.Binary is empty.
const DefaultBinary = "qemu-system-x86_64"

// Machine is one running QEMU process and its monitor connection. It is safe for
// concurrent use; QMP commands are serialised.
type Machine struct {
	cfg Config
	pid int
	// cmd is nil for a machine adopted from an earlier process (Adopt).
	cmd    *exec.Cmd
	qmp    *QMP
	exited chan struct{}
	// waitErr is QEMU's exit status, valid once exited is closed.
	waitErr error
	// args is the command line of an adopted machine.
	args []string
	// timings of Start and, for a restore, of the stream's load.
	timings Timings
}

// Timings say where a machine's start went: Spawn is exec → QMP answering (QEMU's own
// start-up: dynamic linking, machine and device creation, kernel image load), Load the
// migration stream's load on a restore (capabilities, descriptor, migrate-incoming →
// completed; zero for a boot).
type Timings struct {
	Spawn time.Duration
	Load  time.Duration
}

// Start spawns QEMU in its own process group and connects to its monitor. It returns
// once QMP answers; the guest may still be booting (or, with Incoming, waiting for a
// migration stream). On any error nothing is left running.
func Start(ctx context.Context, cfg Config) (*Machine, error) {
	if cfg.Binary == "" {
		cfg.Binary = DefaultBinary
	}
	if cfg.Accel == AccelTCG && cfg.TSCKHz == 0 {
		khz, err := HostTSCKHz()
		if err != nil {
			return nil, err
		}
		cfg.TSCKHz = khz
	}
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	if err := checkRAMFile(cfg.Memory); err != nil {
		return nil, err
	}
	if err := os.Remove(cfg.QMPSocket); err != nil && !errors.Is(err, os.ErrNotExist) {
		return nil, fmt.Errorf("vmm: stale QMP socket: %w", err)
	}
	out := io.Discard
	if cfg.LogFile != "" {
		f, err := os.OpenFile(cfg.LogFile, os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o640)
		if err != nil {
			return nil, fmt.Errorf("vmm: QEMU log: %w", err)
		}
		defer f.Close() // the child keeps its own descriptor
		out = f
	}
	if err := cfg.openDrives(); err != nil {
		return nil, err
	}
	// QEMU holds its own copies once started.
	defer cfg.closeDrives()
	t0 := time.Now()
	cmd := exec.Command(cfg.Binary, cfg.Args()...)
	cmd.Stdout, cmd.Stderr = out, out
	cmd.Env = qemuEnv(os.Environ())
	cmd.ExtraFiles = cfg.extraFiles()
	// A session (and process group) of its own: the node's terminal signals do not reach
	// the VM, it may outlive the node (a restart finds it by its pidfile), and a signal
	// to the group reaches anything QEMU spawned.
	cmd.SysProcAttr = &syscall.SysProcAttr{Setsid: true}
	var stderr tailBuffer
	if cfg.LogFile == "" {
		cmd.Stderr = &stderr
	}
	if err := cmd.Start(); err != nil {
		return nil, fmt.Errorf("vmm: start %s: %w", cfg.Binary, err)
	}
	m := &Machine{cfg: cfg, pid: cmd.Process.Pid, cmd: cmd, exited: make(chan struct{})}
	go func() {
		m.waitErr = cmd.Wait()
		close(m.exited)
	}()
	q, err := m.dialQMP(ctx)
	if err != nil {
		m.Kill()
		if cfg.LogFile != "" {
			stderr.Write(readTail(cfg.LogFile, 2048))
		}
		if msg := strings.TrimSpace(stderr.String()); msg != "" {
			err = fmt.Errorf("%w; qemu: %s", err, msg)
		}
		return nil, err
	}
	m.qmp = q
	m.timings.Spawn = time.Since(t0)
	return m, nil
}

// qemuEnv is QEMU's environment: the node's, with glibc's malloc limited to one arena.
// QEMU's threads (vCPU, I/O workers, RCU) would otherwise each get an arena whose touched
// pages stay private memory of every VM: ~2 MiB of an idle fork's ~30 MiB.
func qemuEnv(env []string) []string {
	for _, kv := range env {
		if strings.HasPrefix(kv, "MALLOC_ARENA_MAX=") {
			return env // the operator's choice
		}
	}
	return append(env, "MALLOC_ARENA_MAX=1")
}

// Timings reports how long the machine's start (and restore) took.
func (m *Machine) Timings() Timings { return m.timings }

// dialQMP retries until QEMU has created its socket (22–33 ms after spawn), QEMU exits
// or ctx ends.
func (m *Machine) dialQMP(ctx context.Context) (*QMP, error) {
	t := time.NewTicker(2 * time.Millisecond)
	defer t.Stop()
	for {
		dctx, cancel := context.WithTimeout(ctx, 2*time.Second)
		q, err := DialQMP(dctx, m.cfg.QMPSocket)
		cancel()
		if err == nil {
			return q, nil
		}
		select {
		case <-m.exited:
			return nil, fmt.Errorf("vmm: QEMU exited before its monitor answered: %v", m.waitErr)
		case <-ctx.Done():
			return nil, fmt.Errorf("vmm: waiting for QMP: %w (last: %v)", ctx.Err(), err)
		case <-t.C:
		}
	}
}

// checkRAMFile enforces the RAM-file rules QEMU would not: a file without write
// permission is a template and must never be mapped shared (the guest would write into
// every fork's memory), and a private mapping must not be larger than the file (QEMU
// would extend the file, changing the template).
func checkRAMFile(mem Memory) error {
	st, err := os.Stat(mem.Path)
	if errors.Is(err, os.ErrNotExist) {
		return nil
	}
	if err != nil {
		return fmt.Errorf("vmm: RAM file: %w", err)
	}
	if mem.Share && st.Mode().Perm()&0o222 == 0 {
		return fmt.Errorf("vmm: RAM file %s is a read-only template: map it private or use a copy", mem.Path)
	}
	if !mem.Share && st.Size() != int64(mem.SizeMiB)<<20 {
		return fmt.Errorf("vmm: RAM file %s is %d bytes, the VM has %d MiB: refusing to resize it",
			mem.Path, st.Size(), mem.SizeMiB)
	}
	return nil
}

// PID is QEMU's process id (also its process group id).
func (m *Machine) PID() int { return m.pid }

// Config is the configuration the machine was started with (defaults filled in).
func (m *Machine) Config() Config { return m.cfg }

// QMP is the monitor connection, for commands this package does not wrap.
func (m *Machine) QMP() *QMP { return m.qmp }

// Exited is closed when the QEMU process has ended.
func (m *Machine) Exited() <-chan struct{} { return m.exited }

// Wait blocks until QEMU exits or ctx ends and returns its exit status.
func (m *Machine) Wait(ctx context.Context) error {
	select {
	case <-m.exited:
		return m.waitErr
	case <-ctx.Done():
		return ctx.Err()
	}
}

// Stop asks QEMU to quit and kills its process group when it has not exited by the end
// of ctx (or within 5 s). Idempotent.
func (m *Machine) Stop(ctx context.Context) error {
	select {
	case <-m.exited:
		m.closeQMP()
		return nil
	default:
	}
	ctx, cancel := context.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	if m.qmp != nil {
		_ = m.qmp.Execute(ctx, "quit", nil, nil) // the answer may be lost as QEMU exits
	}
	select {
	case <-m.exited:
	case <-ctx.Done():
		m.Kill()
	}
	m.closeQMP()
	return nil
}

// Kill ends QEMU's process group with SIGKILL and waits for QEMU to be reaped. Idempotent.
func (m *Machine) Kill() {
	select {
	case <-m.exited:
	default:
		_ = syscall.Kill(-m.pid, syscall.SIGKILL)
		<-m.exited
	}
	m.closeQMP()
}

func (m *Machine) closeQMP() {
	if m.qmp != nil {
		m.qmp.Close()
	}
}

// KillPIDFile ends a QEMU process left by an earlier run (a node restart) whose pidfile
// names it. It checks that the process is QEMU started with that pidfile, so a reused PID
// is never signalled. A missing pidfile or dead process is not an error.
func KillPIDFile(path string) error {
	b, err := os.ReadFile(path)
	if errors.Is(err, os.ErrNotExist) {
		return nil
	}
	if err != nil {
		return fmt.Errorf("vmm: pidfile: %w", err)
	}
	pid, err := strconv.Atoi(strings.TrimSpace(string(b)))
	if err != nil || pid <= 1 {
		return fmt.Errorf("vmm: pidfile %s: malformed %q", path, b)
	}
	args, err := os.ReadFile(fmt.Sprintf("/proc/%d/cmdline", pid))
	if err != nil {
		return nil // gone
	}
	if !bytes.Contains(args, []byte("\x00-pidfile\x00"+path+"\x00")) {
		return nil // PID reused by another process
	}
	if err := syscall.Kill(-pid, syscall.SIGKILL); err != nil && !errors.Is(err, syscall.ESRCH) {
		return fmt.Errorf("vmm: kill QEMU %d: %w", pid, err)
	}
	// Not our child: wait for it to disappear (the init process reaps it).
	for i := 0; i < 500; i++ {
		if _, err := os.Stat(fmt.Sprintf("/proc/%d", pid)); err != nil {
			return nil
		}
		if st, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid)); err == nil && isZombie(st) {
			return nil
		}
		time.Sleep(10 * time.Millisecond)
	}
	return fmt.Errorf("vmm: QEMU %d did not exit after SIGKILL", pid)
}

func isZombie(stat []byte) bool {
	i := bytes.LastIndexByte(stat, ')')
	return i >= 0 && i+2 < len(stat) && stat[i+2] == 'Z'
}

// tailBuffer keeps the last 4 KiB written to it (QEMU's error output).
type tailBuffer struct{ b []byte }

func (t *tailBuffer) Write(p []byte) (int, error) {
	t.b = append(t.b, p...)
	if len(t.b) > 4096 {
		t.b = t.b[len(t.b)-4096:]
	}
	return len(p), nil
}

func (t *tailBuffer) String() string { return string(t.b) }

func readTail(path string, n int64) []byte {
	f, err := os.Open(path)
	if err != nil {
		return nil
	}
	defer f.Close()
	if st, err := f.Stat(); err == nil && st.Size() > n {
		_, _ = f.Seek(-n, io.SeekEnd)
	}
	b, _ := io.ReadAll(f)
	return b
}
