package vmm

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"path/filepath"
	"sync"
	"time"
)

// AccelProbe picks the accelerator for this host: KVM only when a probe VM actually boots
// with it within a timeout, else TCG. The presence of /dev/kvm proves nothing: on some
// hosts it is backed by a nested-virtualisation module under which a stock kernel dies
// with "KVM internal error ... emulation failure" while QEMU keeps running. The result is
// cached per kernel and binary for the life of the prober; a backend keeps one.
type AccelProbe struct {
	// Timeout bounds the probe boot; 0 means 15 s (a KVM guest reaches its panic in
	// well under a second).
	Timeout time.Duration
	Logger  *slog.Logger

	mu    sync.Mutex
	cache map[string]Accel
}

// Detect returns AccelKVM or AccelTCG for VMs booting kernel with binary ("" = default).
// dir is a scratch directory for the probe's files. Only an inability to run the probe
// at all is an error; a KVM that does not work is TCG.
func (p *AccelProbe) Detect(ctx context.Context, binary, kernel, dir string) (Accel, error) {
	if binary == "" {
		binary = DefaultBinary
	}
	key := binary + "\x00" + kernel
	p.mu.Lock()
	defer p.mu.Unlock() // one probe at a time: concurrent callers wait for the answer
	if a, ok := p.cache[key]; ok {
		return a, nil
	}
	a, why, err := p.probe(ctx, binary, kernel, dir)
	if err != nil {
		return "", err
	}
	log := p.Logger
	if log == nil {
		log = slog.Default()
	}
	log.Info("vmm: accelerator chosen", "accel", a, "why", why)
	if p.cache == nil {
		p.cache = map[string]Accel{}
	}
	p.cache[key] = a
	return a, nil
}

func (p *AccelProbe) probe(ctx context.Context, binary, kernel, dir string) (Accel, string, error) {
	if _, err := os.Stat(kernel); err != nil {
		return "", "", fmt.Errorf("vmm: accel probe: kernel: %w", err)
	}
	f, err := os.OpenFile("/dev/kvm", os.O_RDWR, 0)
	if err != nil {
		return AccelTCG, "cannot open /dev/kvm: " + err.Error(), nil
	}
	f.Close()
	timeout := p.Timeout
	if timeout == 0 {
		timeout = 15 * time.Second
	}
	ok, why, err := bootProbe(ctx, AccelKVM, binary, kernel, dir, timeout)
	if err != nil || !ok {
		return AccelTCG, why, err
	}
	return AccelKVM, why, nil
}

// bootProbe boots kernel under accel until it panics for want of a root filesystem and
// reports whether it got there within timeout. A QEMU that hangs (as it does on a broken
// KVM) is killed by PID.
func bootProbe(ctx context.Context, accel Accel, binary, kernel, dir string, timeout time.Duration) (bool, string, error) {
	pdir, err := os.MkdirTemp(dir, "accel-probe-")
	if err != nil {
		return false, "", fmt.Errorf("vmm: accel probe: %w", err)
	}
	defer os.RemoveAll(pdir)
	console := filepath.Join(pdir, "console.log")
	// No initrd: the kernel boots until it cannot mount a root filesystem, panics, and
	// panic=-1 plus -no-reboot make QEMU exit. Reaching that panic proves the CPU works.
	cfg := Config{
		Binary: binary, Accel: accel, CPUs: 1,
		Memory:     Memory{SizeMiB: 128, Path: filepath.Join(pdir, "ram")},
		Kernel:     kernel,
		Cmdline:    "console=ttyS0 panic=-1 quiet",
		ConsoleLog: console, QMPSocket: filepath.Join(pdir, "qmp.sock"),
		LogFile: filepath.Join(pdir, "qemu.log"),
	}
	pctx, cancel := context.WithTimeout(ctx, timeout)
	defer cancel()
	m, err := Start(pctx, cfg)
	if err != nil {
		if ctx.Err() != nil {
			return false, "", fmt.Errorf("vmm: accel probe: %w", ctx.Err())
		}
		return false, fmt.Sprintf("%s VM did not start: %v", accel, err), nil
	}
	defer m.Kill()
	werr := m.Wait(pctx)
	if ctx.Err() != nil {
		return false, "", fmt.Errorf("vmm: accel probe: %w", ctx.Err())
	}
	if errors.Is(werr, context.DeadlineExceeded) {
		return false, fmt.Sprintf("%s probe VM did not finish booting within %v", accel, timeout), nil
	}
	out, _ := os.ReadFile(console)
	if !bytes.Contains(out, []byte("Kernel panic")) {
		return false, fmt.Sprintf("%s probe VM exited without booting its kernel", accel), nil
	}
	return true, fmt.Sprintf("a %s probe VM booted", accel), nil
}
