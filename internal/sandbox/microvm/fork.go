package microvm

import (
	"context"
	"errors"
	"fmt"
	"os"
	"sync"
	"time"

	"github.com/aenv-dev/aenv/internal/rootfs"
	"github.com/aenv-dev/aenv/internal/sandbox"
	"github.com/aenv-dev/aenv/internal/storage/stack"
	"github.com/aenv-dev/aenv/internal/vmm"
)

// Fork implements sandbox.Instance: one capture, then every child restores on a private
// mapping of its RAM file (copy-on-write: the children share the pages none of them
// wrote) with a disk of its own on the sealed layers.
func (i *Instance) Fork(ctx context.Context, specs []sandbox.ForkSpec) ([]sandbox.ForkResult, error) {
	c, err := i.capture(ctx, captureFork)
	if err != nil {
		return nil, err
	}
	// Children keep their mapping when the file goes.
	defer removeImage(i.b, c)
	i.mu.Lock()
	allow := i.slot != nil && i.slot.AllowInternet
	i.mu.Unlock()
	out := make([]sandbox.ForkResult, len(specs))
	var wg sync.WaitGroup
	for n, s := range specs {
		wg.Add(1)
		go func() {
			defer wg.Done()
			inst, err := i.b.Launch(ctx, sandbox.LaunchPlan{Kind: sandbox.LaunchFromSnapshot,
				SandboxID: s.SandboxID, Resources: s.Resources, AllowInternet: allow, Snapshot: c})
			out[n] = sandbox.ForkResult{Instance: inst, Err: err}
			if err == nil {
				i.b.crashPoint(crashForkLaunched)
			}
		}()
	}
	wg.Wait()
	return out, nil
}

// launchCaptured launches a sandbox from a capture: a snapshot (a new sandbox, or one
// paused to disk) or a pause (the same sandbox). It continues the captured processes
// unless the plan asks for a cold boot or the capture has no memory.
func (b *Backend) launchCaptured(ctx context.Context, plan sandbox.LaunchPlan) (sandbox.Instance, error) {
	var raw any = plan.Snapshot
	if plan.Kind == sandbox.LaunchResume {
		raw = plan.Paused
	}
	c, ok := raw.(*capture)
	if !ok || c == nil {
		return nil, fmt.Errorf("microvm: launch kind %d: %T is not a microvm capture", plan.Kind, raw)
	}
	if plan.ColdBoot || c.Memory == nil {
		fresh := plan
		fresh.Kind = sandbox.LaunchFresh
		fresh.RootFS = sandbox.RootFS{Layers: c.Layers, VirtualSize: c.VirtualSize}
		fresh.Snapshot, fresh.Paused = nil, nil
		return b.Launch(ctx, fresh)
	}
	if b.poolable(plan, c) {
		if inst := b.vmpool.take(ctx, plan, c); inst != nil {
			return inst, nil
		}
	}
	inst, err := b.reserve(plan.SandboxID, c.Resources)
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
	if err := b.restore(ctx, inst, c, plan.Kind == sandbox.LaunchResume, plan.AllowInternet); err != nil {
		if serr := inst.Stop(context.WithoutCancel(ctx)); serr != nil {
			b.log.Warn("microvm: cleanup after failed restore", "id", plan.SandboxID, "err", serr)
		}
		return nil, err
	}
	return inst, nil
}

// restore gives inst a network slot, a disk on the capture's layers and a QEMU loaded
// from the capture's memory image, and continues the guest.
func (b *Backend) restore(ctx context.Context, inst *Instance, c *capture, resume, allowInternet bool) error {
	t0 := time.Now()
	slot, err := b.takeSlot(ctx, inst, allowInternet)
	if err != nil {
		return err
	}
	layers := make([]stack.LayerRef, len(c.Layers))
	for n, l := range c.Layers {
		layers[n] = stack.LayerRef{Path: l.Path, Digest: l.Digest, Size: l.Size, UUID: l.UUID}
	}
	t1 := time.Now()
	disk, err := rootfs.OpenDisk(ctx, rootfs.Spec{Dir: inst.dir, Lowers: layers, VirtualSize: c.VirtualSize, Resolver: b.cfg.LayerResolver, Open: b.diskOpener()})
	if err != nil {
		return fmt.Errorf("microvm: root disk: %w", err)
	}
	inst.mu.Lock()
	inst.disk = disk
	inst.mu.Unlock()
	t2 := time.Now()
	nic, err := b.attachRestoredTap(ctx, slot, c.Guest)
	if err != nil {
		return err
	}
	defer nic.tap.Close()
	t3 := time.Now()
	// A fork maps the capture's RAM file private; a resumed pause runs shared on a copy
	// of it of its own (so its next pause is cheap again); a full stream loads into a
	// fresh RAM file of the VM's own.
	ramPath, statePath, err := b.localImage(ctx, c)
	if err != nil {
		return err
	}
	ram, private := inst.ramFile, false
	switch {
	case ramPath != "" && resume:
		if err := vmm.CopyRAMFile(ramPath, inst.ramFile); err != nil {
			return fmt.Errorf("microvm: resume: %w", err)
		}
	case ramPath != "":
		ram, private = ramPath, true
	}
	t4 := time.Now()
	spec := b.vmSpec(inst, disk.Path(), nic)
	spec.ramFile, spec.privateRAM = ram, private
	// Not read by a restored guest, but QEMU loads the kernel all the same.
	spec.cmdline = "console=ttyS0"
	state := c.Memory.vmState(statePath)
	proc, err := startVM(ctx, spec, &state)
	if err != nil {
		return err
	}
	inst.mu.Lock()
	inst.proc = proc
	guest := c.Guest
	inst.mem = memState{privateRAM: private, guest: &guest}
	inst.mu.Unlock()
	if err := inst.saveState(); err != nil {
		return err
	}
	t5 := time.Now()
	if err := proc.m.Resume(ctx); err != nil {
		return fmt.Errorf("microvm: continue restored VM: %w", err)
	}
	if resume {
		// The pause is consumed: this VM has its own copy of the RAM.
		if err := removeImage(b, c); err != nil {
			b.log.Warn("microvm: remove a resumed pause's memory image", "id", inst.id, "err", err)
		}
	}
	qt := proc.m.Timings()
	b.log.Debug("microvm: restored", "id", inst.id, "capture", c.ID, "slot", slot.Index, "pid", proc.pid,
		"network", t1.Sub(t0), "disk", t2.Sub(t1), "tap", t3.Sub(t2), "memory", t4.Sub(t3), "qemu", t5.Sub(t4),
		"qemu_spawn", qt.Spawn, "qemu_load", qt.Load, "cont", time.Since(t5), "total", time.Since(t0))
	return nil
}
