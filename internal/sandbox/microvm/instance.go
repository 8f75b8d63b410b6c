package microvm

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"os"
	"strconv"
	"sync"
	"time"

	"github.com/aenv-dev/aenv/internal/network"
	"github.com/aenv-dev/aenv/internal/rootfs"
	"github.com/aenv-dev/aenv/internal/sandbox"
	"github.com/aenv-dev/aenv/internal/storage/blockdev"
)

// Instance is one sandbox VM.
type Instance struct {
	b       *Backend
	id      string
	dir     string
	ramFile string
	res     sandbox.Resources
	started time.Time
	// adopted: a restart found this VM running and took it over (Reconcile).
	adopted bool

	// stopMu serialises Stop (and, later, snapshots) against each other.
	stopMu sync.Mutex

	mu   sync.Mutex
	slot *network.Slot
	disk *rootfs.Disk
	proc *vmProc
	// mem is how the VM holds its memory (memory snapshots, snapshot.go).
	mem memState
	// envdToken is the access token its envd holds (LaunchPlan.EnvdAccessToken; unknown
	// after a restart), which the snapshot pool's warm-up of its captures needs.
	envdToken string

	stopped bool
	// cpu is the last CPU-time sample, for Stats' usage between two calls.
	cpu cpuSample
}

var _ sandbox.Instance = (*Instance)(nil)

// ID implements sandbox.Instance.
func (i *Instance) ID() string { return i.id }

// Endpoint implements sandbox.Instance: the guest holds the slot's address.
func (i *Instance) Endpoint() sandbox.Endpoint {
	i.mu.Lock()
	defer i.mu.Unlock()
	if i.slot == nil {
		return sandbox.Endpoint{EnvdPort: i.b.cfg.EnvdPort}
	}
	return sandbox.Endpoint{Host: i.slot.IP.String(), EnvdPort: i.b.cfg.EnvdPort}
}

// PID is QEMU's process id (0 before it started).
func (i *Instance) PID() int {
	i.mu.Lock()
	defer i.mu.Unlock()
	if i.proc == nil {
		return 0
	}
	return i.proc.pid
}

// ConsoleLog is the path of the guest's serial console log (boot diagnostics).
func (i *Instance) ConsoleLog() string { return i.dir + "/" + consoleLog }

// Resume implements sandbox.Instance: nothing pauses in place. The one instance a paused
// sandbox can have is a VM a restart adopted whose resume the crash interrupted after the
// VM was restored and running (its record still said paused): that resume is done.
func (i *Instance) Resume(context.Context) error {
	i.mu.Lock()
	defer i.mu.Unlock()
	if i.adopted && !i.stopped && i.proc != nil && !i.proc.exited() {
		return nil
	}
	return fmt.Errorf("%w: %s is not paused in place", sandbox.ErrGone, i.id)
}

// Stop implements sandbox.Instance: QEMU is killed by pid, then its disk, network slot, RAM
// file and directory are released. Idempotent; after an error a second Stop retries what
// is left.
func (i *Instance) Stop(ctx context.Context) error {
	i.stopMu.Lock()
	defer i.stopMu.Unlock()
	i.mu.Lock()
	proc, disk, slot := i.proc, i.disk, i.slot
	i.stopped = true
	i.mu.Unlock()
	var errs []error
	if proc != nil {
		if err := proc.kill(ctx); err != nil {
			// The disk and slot are still in use: keep them for a retry.
			return err
		}
	}
	if disk != nil {
		// A dead QEMU's last reference to the disk file can go a moment after its exit;
		// a disk still held then was detached and is released by itself.
		err := disk.Close()
		if errors.Is(err, blockdev.ErrStillInUse) {
			i.b.log.Warn("microvm: disk still held after the stop; it is released when its last user goes", "id", i.id, "err", err)
		}
		if err := blockdev.WithoutStillInUse(err); err != nil {
			errs = append(errs, err)
		} else {
			i.mu.Lock()
			i.disk = nil
			i.mu.Unlock()
		}
	}
	if slot != nil {
		if err := i.b.pool.Release(ctx, slot); err != nil {
			errs = append(errs, err)
		} else {
			i.mu.Lock()
			i.slot = nil
			i.mu.Unlock()
		}
	}
	if err := os.Remove(i.ramFile); err != nil && !errors.Is(err, os.ErrNotExist) {
		errs = append(errs, err)
	}
	if len(errs) > 0 {
		return errors.Join(errs...)
	}
	if err := os.RemoveAll(i.dir); err != nil {
		return fmt.Errorf("microvm: remove %s: %w", i.dir, err)
	}
	i.b.forget(i)
	return nil
}

// Stats implements sandbox.Instance from the host's view of QEMU: CPU is the process's
// (vCPU threads included) since the last call, memory its resident set against the
// guest's RAM, disk the upper's size against the device.
func (i *Instance) Stats(ctx context.Context) (sandbox.Stats, error) {
	i.mu.Lock()
	defer i.mu.Unlock()
	if i.stopped || i.proc == nil || i.proc.exited() {
		return sandbox.Stats{}, fmt.Errorf("%w: %s", sandbox.ErrGone, i.id)
	}
	now := time.Now()
	s := sandbox.Stats{Timestamp: now, CPUCount: i.res.CPUCount, MemTotal: int64(i.res.MemoryMB) << 20}
	if ticks, rss, err := procUsage(i.proc.pid); err == nil {
		s.MemUsed = rss
		if prev := i.cpu; !prev.at.IsZero() && now.After(prev.at) {
			secs := float64(ticks-prev.ticks) / clockTicks
			s.CPUUsedPct = 100 * secs / now.Sub(prev.at).Seconds() / float64(max(i.res.CPUCount, 1))
		}
		i.cpu = cpuSample{at: now, ticks: ticks}
	}
	if i.disk != nil {
		s.DiskTotal = i.disk.Size()
		if fi, err := os.Stat(i.dir + "/upper.data"); err == nil {
			s.DiskUsed = fi.Size()
		}
	}
	return s, nil
}

type cpuSample struct {
	at    time.Time
	ticks uint64
}

// clockTicks is USER_HZ, the unit of /proc/PID/stat's CPU times (100 on every Linux ABI).
const clockTicks = 100

// procUsage reads a process's user+system CPU time (ticks) and resident set (bytes).
func procUsage(pid int) (ticks uint64, rss int64, err error) {
	st, err := os.ReadFile("/proc/" + strconv.Itoa(pid) + "/stat")
	if err != nil {
		return 0, 0, err
	}
	i := bytes.LastIndexByte(st, ')')
	if i < 0 {
		return 0, 0, errors.New("microvm: bad /proc stat")
	}
	f := bytes.Fields(st[i+1:])
	// After the command: state(0) ... utime(11) stime(12) ... rss(21), in pages.
	if len(f) < 22 {
		return 0, 0, errors.New("microvm: short /proc stat")
	}
	ut, _ := strconv.ParseUint(string(f[11]), 10, 64)
	sy, _ := strconv.ParseUint(string(f[12]), 10, 64)
	pages, _ := strconv.ParseInt(string(f[21]), 10, 64)
	return ut + sy, pages * int64(os.Getpagesize()), nil
}
