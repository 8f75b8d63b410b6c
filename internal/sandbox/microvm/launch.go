package microvm

import (
	"context"
	"errors"
	"fmt"
	"net/netip"
	"os"
	"path/filepath"
	"time"

	"github.com/aenv-dev/aenv/internal/network"
	"github.com/aenv-dev/aenv/internal/rootfs"
	"github.com/aenv-dev/aenv/internal/sandbox"
	"github.com/aenv-dev/aenv/internal/storage/stack"
)

// Names inside a sandbox's directory.
const (
	stateFile   = "state.json"
	pidFileName = "qemu.pid"
	qmpSock     = "qmp.sock"
	consoleLog  = "console.log"
	qemuLog     = "qemu.log"
)

// Launch implements sandbox.Backend: a fresh sandbox boots the template's layered root on
// a writable upper of its own. It returns once QEMU answers on its QMP socket; the guest
// is still booting (the orchestrator waits for envd).
func (b *Backend) Launch(ctx context.Context, plan sandbox.LaunchPlan) (sandbox.Instance, error) {
	inst, err := b.launch(ctx, plan)
	if err != nil {
		return nil, err
	}
	if i, ok := inst.(*Instance); ok {
		i.mu.Lock()
		i.envdToken = plan.EnvdAccessToken
		i.mu.Unlock()
	}
	return inst, nil
}

func (b *Backend) launch(ctx context.Context, plan sandbox.LaunchPlan) (sandbox.Instance, error) {
	if !idRE.MatchString(plan.SandboxID) {
		return nil, fmt.Errorf("microvm: invalid sandbox id %q", plan.SandboxID)
	}
	defer b.vmpool.request()()
	r := plan.Resources
	if r.CPUCount < 0 || r.MemoryMB < 0 || r.DiskSizeMB < 0 {
		return nil, fmt.Errorf("microvm: negative resources %+v", r)
	}
	switch plan.Kind {
	case sandbox.LaunchFresh:
	case sandbox.LaunchFromSnapshot, sandbox.LaunchResume:
		return b.launchCaptured(ctx, plan)
	default:
		return nil, fmt.Errorf("microvm: unknown launch kind %d", plan.Kind)
	}
	if len(plan.RootFS.Layers) == 0 {
		return nil, fmt.Errorf("%w: a microVM boots layered templates only (this one is a directory)", ErrUnsupported)
	}
	layers := make([]stack.LayerRef, len(plan.RootFS.Layers))
	for n, l := range plan.RootFS.Layers {
		if !filepath.IsAbs(l.Path) && (l.Path != "" || l.Digest == "") {
			return nil, fmt.Errorf("microvm: layer %+v has neither an absolute path nor a digest", l)
		}
		if l.Path == "" && b.cfg.LayerResolver == nil {
			return nil, fmt.Errorf("microvm: layer %s has no path and no LayerResolver is configured", l.Digest)
		}
		layers[n] = stack.LayerRef{Path: l.Path, Digest: l.Digest, Size: l.Size, UUID: l.UUID}
	}
	if r.CPUCount == 0 {
		r.CPUCount = b.cfg.CPUs
	}
	if r.MemoryMB == 0 {
		r.MemoryMB = b.cfg.MemoryMB
	}
	vsize := plan.RootFS.VirtualSize
	if want := uint64(r.DiskSizeMB) << 20; vsize > 0 && want > vsize {
		vsize = want
	}
	inst, err := b.reserve(plan.SandboxID, r)
	if err != nil {
		return nil, err
	}
	if err := os.Mkdir(inst.dir, 0o700); err != nil {
		b.forget(inst)
		if errors.Is(err, os.ErrExist) {
			return nil, fmt.Errorf("%w: %s has a directory on disk (Reconcile not run?)", ErrExists, plan.SandboxID)
		}
		return nil, fmt.Errorf("microvm: %w", err)
	}
	if err := b.boot(ctx, inst, layers, vsize, plan.AllowInternet); err != nil {
		// A cancelled launch must still leave nothing behind.
		if serr := inst.Stop(context.WithoutCancel(ctx)); serr != nil {
			b.log.Warn("microvm: cleanup after failed launch", "id", plan.SandboxID, "err", serr)
		}
		return nil, err
	}
	return inst, nil
}

// reserve registers a new instance under id, or fails if the id is taken.
func (b *Backend) reserve(id string, r sandbox.Resources) (*Instance, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	if _, ok := b.instances[id]; ok {
		return nil, fmt.Errorf("%w: %s", ErrExists, id)
	}
	inst := &Instance{
		b: b, id: id, res: r, started: time.Now(),
		dir:     filepath.Join(b.cfg.sandboxesDir(), id),
		ramFile: filepath.Join(b.cfg.RAMDir, id+".ram"),
	}
	b.instances[id] = inst
	return inst, nil
}

func (b *Backend) forget(inst *Instance) {
	b.mu.Lock()
	if b.instances[inst.id] == inst {
		delete(b.instances, inst.id)
	}
	b.mu.Unlock()
}

// takeSlot gives inst a network slot and records it in inst's state file first, so a
// node that dies before QEMU starts still finds and releases the slot at Reconcile.
func (b *Backend) takeSlot(ctx context.Context, inst *Instance, allowInternet bool) (*network.Slot, error) {
	slot, err := b.pool.Acquire(ctx, allowInternet)
	if err != nil {
		return nil, fmt.Errorf("microvm: network slot: %w", err)
	}
	inst.mu.Lock()
	inst.slot = slot
	inst.mu.Unlock()
	if err := inst.saveState(); err != nil {
		return nil, err
	}
	return slot, nil
}

// boot gives inst a network slot, its root disk and a running QEMU.
func (b *Backend) boot(ctx context.Context, inst *Instance, layers []stack.LayerRef, vsize uint64, allowInternet bool) error {
	t0 := time.Now()
	slot, err := b.takeSlot(ctx, inst, allowInternet)
	if err != nil {
		return err
	}
	t1 := time.Now()
	disk, err := rootfs.OpenDisk(ctx, rootfs.Spec{Dir: inst.dir, Lowers: layers, VirtualSize: vsize, Resolver: b.cfg.LayerResolver, Open: b.diskOpener()})
	if err != nil {
		return fmt.Errorf("microvm: root disk: %w", err)
	}
	inst.mu.Lock()
	inst.disk = disk
	inst.mu.Unlock()
	t2 := time.Now()
	if err := b.startQEMU(ctx, inst); err != nil {
		return err
	}
	b.log.Debug("microvm: started", "id", inst.id, "slot", slot.Index, "pid", inst.PID(),
		"network", t1.Sub(t0), "disk", t2.Sub(t1), "qemu", time.Since(t2))
	return nil
}

// startQEMU boots inst's VM on its slot and disk: a new tap in the slot, the guest's
// command line, QEMU, and its QMP socket.
func (b *Backend) startQEMU(ctx context.Context, inst *Instance) error {
	inst.mu.Lock()
	slot, disk := inst.slot, inst.disk
	inst.mu.Unlock()
	nic, err := attachTap(slot)
	if err != nil {
		return err
	}
	// QEMU holds the tap from here on; ours must not keep the interface alive.
	defer nic.tap.Close()
	spec := b.vmSpec(inst, disk.Path(), nic)
	params := bootParams{
		ip: netip.PrefixFrom(slot.IP, slot.PrefixLen), gateway: slot.Gateway, hostname: sandbox.Hostname(inst.id),
		dns: b.dns, envdPort: b.cfg.EnvdPort,
	}
	spec.cmdline = params.cmdline()
	proc, err := startVM(ctx, spec, nil)
	if err != nil {
		return err
	}
	inst.mu.Lock()
	inst.proc = proc
	inst.mu.Unlock()
	// What a restart needs to adopt the VM.
	return inst.saveState()
}

// vmSpec is inst's machine: the same for a boot and every restore of its snapshots.
func (b *Backend) vmSpec(inst *Instance, disk string, nic *guestNIC) vmSpec {
	return vmSpec{
		qemu: b.cfg.QEMU, accel: string(b.accel), tscKHz: b.cfg.TSCKHz, tbSizeMiB: b.cfg.TBSizeMiB, kernel: b.cfg.Kernel, initrd: b.initrd,
		cpus: inst.res.CPUCount, memMB: inst.res.MemoryMB, ramFile: inst.ramFile, disk: disk, nic: nic,
		pidFile: filepath.Join(inst.dir, pidFileName), qmp: filepath.Join(inst.dir, qmpSock),
		console: filepath.Join(inst.dir, consoleLog), log: filepath.Join(inst.dir, qemuLog),
		confine: b.confine,
	}
}
