package orchestrator

import (
	"fmt"
	"runtime"
	"syscall"

	"github.com/aenv-dev/aenv/internal/sandbox"
)

// Capacity is what a node can ever give its sandboxes. A sandbox asking for more than one
// of these limits could never run here (ErrInvalid). Sandboxes holding resources together
// may not commit more memory than MemoryMB (ErrCapacity: the node is full). Zero fields
// are unlimited.
type Capacity struct {
	// CPUCount bounds one sandbox's cpuCount only: CPU limits are quotas of time-shared
	// CPUs, not reservations, so they are not summed.
	CPUCount int
	MemoryMB int
	// DiskSizeMB bounds one sandbox's disk only: root images are sparse, so disks are not
	// summed.
	DiskSizeMB int
}

// HostCapacity is the host's CPUs and memory times the overcommit ratios, and the size of
// the filesystem holding dataDir. A ratio of 0 leaves that resource unlimited.
func HostCapacity(dataDir string, cpuOvercommit, memoryOvercommit float64) (Capacity, error) {
	var c Capacity
	if cpuOvercommit > 0 {
		c.CPUCount = max(1, int(float64(runtime.NumCPU())*cpuOvercommit))
	}
	if memoryOvercommit > 0 {
		var si syscall.Sysinfo_t
		if err := syscall.Sysinfo(&si); err != nil {
			return c, fmt.Errorf("read the host's memory size: %w", err)
		}
		hostMB := float64(si.Totalram) * float64(si.Unit) / (1 << 20)
		c.MemoryMB = max(64, int(hostMB*memoryOvercommit))
	}
	var st syscall.Statfs_t
	if err := syscall.Statfs(dataDir, &st); err != nil {
		return c, fmt.Errorf("read the size of the filesystem of %s: %w", dataDir, err)
	}
	c.DiskSizeMB = int(st.Blocks * uint64(st.Bsize) >> 20)
	return c, nil
}

// Check refuses resources a sandbox could never get on this node; the message names the
// field and the limit. The orchestrator wraps it in ErrInvalid; the API edge checks pulls,
// builds and creates with it before anything starts.
func (c Capacity) Check(r sandbox.Resources) error {
	for _, f := range []struct {
		field, unit, why string
		want, limit      int
	}{
		{"cpuCount", "", "host CPUs × sandbox.cpu_overcommit", r.CPUCount, c.CPUCount},
		{"memoryMB", " MB", "host memory × sandbox.memory_overcommit", r.MemoryMB, c.MemoryMB},
		{"diskSizeMB", " MB", "the size of the node's data filesystem", r.DiskSizeMB, c.DiskSizeMB},
	} {
		if f.limit > 0 && f.want > f.limit {
			return fmt.Errorf("%s %d is more than this node can ever give a sandbox: the limit is %d%s (%s)",
				f.field, f.want, f.limit, f.unit, f.why)
		}
	}
	return nil
}

// holdsResources says whether a sandbox counts against the node's capacity: every one
// except those paused to disk, or paused on a backend whose pause releases memory.
func (o *Orchestrator) holdsResources(e *entry) bool {
	return e.rec.State != StatePaused || (!o.backend.Capabilities().PauseReleasesMemory && e.rec.DiskSnapshot == nil)
}

// admitLocked refuses a new sandbox with resources r when the node is shutting down, at
// the configured sandbox limit, or when its memory does not fit next to what the
// sandboxes holding resources have committed.
func (o *Orchestrator) admitLocked(r sandbox.Resources) error {
	if o.closing {
		return fmt.Errorf("%w: node is shutting down", ErrCapacity)
	}
	n, mem := 0, 0
	for _, e := range o.entries {
		if !o.holdsResources(e) {
			continue
		}
		n++
		mem += e.rec.Resources.MemoryMB
	}
	if o.cfg.MaxSandboxes > 0 && n >= o.cfg.MaxSandboxes {
		return fmt.Errorf("%w: %d of %d sandboxes in use", ErrCapacity, n, o.cfg.MaxSandboxes)
	}
	if c := o.cfg.Capacity; c.MemoryMB > 0 && mem+r.MemoryMB > c.MemoryMB {
		return fmt.Errorf("%w: sandboxes hold %d of its %d MB of memory and this one asks for %d MB; "+
			"kill or pause sandboxes, or ask for less memory", ErrCapacity, mem, c.MemoryMB, r.MemoryMB)
	}
	return nil
}
