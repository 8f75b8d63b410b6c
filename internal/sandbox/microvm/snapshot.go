package microvm

import (
	"context"
	"errors"
	"fmt"
	"net/netip"
	"os"
	"path/filepath"
	"time"

	"github.com/vishvananda/netlink"
	"github.com/vishvananda/netns"

	"github.com/aenv-dev/aenv/internal/network"
	"github.com/aenv-dev/aenv/internal/sandbox"
	"github.com/aenv-dev/aenv/internal/vmm"
)

// memState is how a VM holds its memory.
type memState struct {
	// privateRAM: the VM runs on a private mapping of a capture's RAM file (a fork or a
	// snapshot launch). Its own snapshots then carry the RAM in the stream (SaveFull).
	// Otherwise its RAM file is its own, shared, and a snapshot is its device state plus
	// that file.
	privateRAM bool
	// guest is the network identity in the guest's memory when it came from a capture
	// (nil for a VM that booted in its slot).
	guest *guestIdentity
}

// captureKind says what a capture is for, which decides where its memory image goes.
type captureKind int

const (
	// captureSnapshot: the VM continues; the image is persistent (on disk).
	captureSnapshot captureKind = iota
	// capturePause: the VM ends after the capture; the image is persistent.
	capturePause
	// captureFork: the VM continues; the image is transient (tmpfs) and goes once the
	// children have mapped it.
	captureFork
)

// Snapshot implements sandbox.Instance: the VM stops for the device state, a copy of its
// RAM file and the seal of its disk's upper, then continues.
func (i *Instance) Snapshot(ctx context.Context) (sandbox.Captured, error) {
	c, err := i.capture(ctx, captureSnapshot)
	if err != nil {
		return nil, err
	}
	i.b.vmpool.prime(c)
	return c, nil
}

// capture stops the VM and writes a capture of it. For a pause the VM stays stopped; the
// caller ends the VM. Otherwise the VM continues. Any error before the end leaves the VM
// running (recoverable) unless it has died (ErrGone).
func (i *Instance) capture(ctx context.Context, kind captureKind) (_ *capture, err error) {
	pause := kind == capturePause
	i.stopMu.Lock()
	defer i.stopMu.Unlock()
	i.mu.Lock()
	proc, disk, slot, mem, stopped, token := i.proc, i.disk, i.slot, i.mem, i.stopped, i.envdToken
	i.mu.Unlock()
	if stopped || proc == nil || proc.exited() || disk == nil || slot == nil {
		return nil, fmt.Errorf("%w: %s", sandbox.ErrGone, i.id)
	}
	c, err := i.newCapture(disk.Size(), slot, mem, kind != captureFork)
	if err != nil {
		return nil, err
	}
	c.envdToken = token
	m := proc.m
	t0 := time.Now()
	sealed := false
	defer func() {
		if err == nil {
			return
		}
		_ = removeImage(i.b, c)
		if !sealed { // once sealed, the layer is a lower of the running disk
			os.RemoveAll(c.Dir)
		}
		if proc.exited() {
			err = fmt.Errorf("%w: %s died during a capture: %v", sandbox.ErrGone, i.id, err)
			return
		}
		// The sandbox goes on as it was (its disk may have a new lower: harmless).
		if rerr := m.Resume(context.WithoutCancel(ctx)); rerr != nil {
			err = errors.Join(err, rerr)
		}
	}()
	var st vmm.State
	if mem.privateRAM {
		st, err = m.SaveFull(ctx, filepath.Join(c.Memory.Dir, stateName))
	} else {
		st, err = m.SaveDeviceState(ctx, filepath.Join(c.Memory.Dir, stateName))
	}
	if err != nil {
		return nil, fmt.Errorf("microvm: capture %s: %w", i.id, err)
	}
	c.Memory.State = memBlob{Path: st.Path, Size: st.Size, Role: roleVMState}
	c.Memory.IgnoreShared = st.IgnoreShared
	tState := time.Now()
	i.b.crashPoint(crashCaptureState)
	// QEMU flushed the disk at the stop: the upper holds everything the guest wrote.
	layerPath := filepath.Join(c.Dir, "disk.lsmt")
	lowers, _, err := disk.Seal(ctx, layerPath)
	if _, serr := os.Stat(layerPath); serr == nil {
		sealed = true
	}
	if err != nil {
		return nil, fmt.Errorf("microvm: capture %s: seal disk: %w", i.id, err)
	}
	for _, l := range lowers {
		c.Layers = append(c.Layers, sandbox.LayerRef{Path: l.Path, Digest: l.Digest, Size: l.Size, UUID: l.UUID})
	}
	i.b.crashPoint(crashCaptureSealed)
	tDisk := time.Now()
	if !mem.privateRAM {
		if err := i.captureRAM(c, kind != captureFork); err != nil {
			return nil, err
		}
	} else if kind != captureFork {
		if err := syncFiles(c.Memory.State.Path); err != nil {
			return nil, fmt.Errorf("microvm: capture %s: %w", i.id, err)
		}
	}
	tRAM := time.Now()
	i.b.crashPoint(crashCaptureRAM)
	if !pause {
		if err := m.Resume(ctx); err != nil {
			return nil, fmt.Errorf("microvm: capture %s: continue: %w", i.id, err)
		}
	}
	i.b.log.Debug("microvm: captured", "id", i.id, "capture", c.ID, "pause", pause,
		"state", tState.Sub(t0), "disk", tDisk.Sub(tState), "ram", tRAM.Sub(tDisk), "total", time.Since(t0))
	return c, nil
}

// Names of a memory image's files in its directory.
const (
	ramName   = "ram"
	stateName = "state"
)

// newCapture names a capture of inst and creates its directories: its memory image goes
// next to its disk layer when persistent, on tmpfs otherwise.
func (i *Instance) newCapture(diskSize int64, slot *network.Slot, mem memState, persistent bool) (*capture, error) {
	guest := mem.guest
	if guest == nil {
		g, err := slotIdentity(slot.NetnsPath, slot.IP, slot.PrefixLen, slot.Gateway)
		if err != nil {
			return nil, err
		}
		if br, err := gatewayLink(slot.Gateway); err == nil {
			g.GatewayMAC = br.Attrs().HardwareAddr.String()
		}
		guest = &g
	}
	id, err := newCaptureID()
	if err != nil {
		return nil, err
	}
	c := &capture{Backend: "microvm", ID: id, Dir: filepath.Join(i.b.cfg.capturesDir(), id),
		VirtualSize: uint64(diskSize), Resources: i.res, Guest: *guest, Memory: &memImage{}}
	c.Memory.Dir = c.Dir
	if !persistent {
		c.Memory.Dir = filepath.Join(i.b.cfg.imagesDir(), id)
	}
	for _, d := range []string{c.Dir, c.Memory.Dir} {
		err := os.MkdirAll(d, 0o700)
		if errors.Is(err, os.ErrNotExist) { // a discard removed the emptied parent meanwhile
			err = os.MkdirAll(d, 0o700)
		}
		if err != nil {
			return nil, fmt.Errorf("microvm: capture: %w", err)
		}
	}
	return c, nil
}

// captureRAM copies the stopped VM's own RAM file into the capture's memory image
// (keeping holes: only what the guest touched is written). A persistent image is synced
// to disk before the capture counts as taken.
func (i *Instance) captureRAM(c *capture, persistent bool) error {
	path := filepath.Join(c.Memory.Dir, ramName)
	err := vmm.CopyRAMFile(i.ramFile, path)
	if err == nil && persistent {
		err = syncFiles(path, c.Memory.State.Path)
	}
	if err == nil {
		err = vmm.MarkTemplate(path)
	}
	if err != nil {
		return fmt.Errorf("microvm: capture %s: RAM: %w", i.id, err)
	}
	st, err := os.Stat(path)
	if err != nil {
		return fmt.Errorf("microvm: capture %s: RAM: %w", i.id, err)
	}
	c.Memory.RAM = &memBlob{Path: path, Size: st.Size(), Role: roleMemory}
	return nil
}

// syncFiles flushes files to disk.
func syncFiles(paths ...string) error {
	for _, p := range paths {
		f, err := os.Open(p)
		if err != nil {
			return err
		}
		err = f.Sync()
		f.Close()
		if err != nil {
			return fmt.Errorf("sync %s: %w", p, err)
		}
	}
	return nil
}

// slotIdentity is the identity a VM that booted in slot has: the slot's address and
// gateway, and the MAC of the slot's eth0, which the guest took.
func slotIdentity(nsPath string, ip netip.Addr, prefix int, gw netip.Addr) (guestIdentity, error) {
	ns, err := netns.GetFromPath(nsPath)
	if err != nil {
		return guestIdentity{}, fmt.Errorf("microvm: netns %s: %w", nsPath, err)
	}
	defer ns.Close()
	h, err := netlink.NewHandleAt(ns)
	if err != nil {
		return guestIdentity{}, fmt.Errorf("microvm: netlink in %s: %w", nsPath, err)
	}
	defer h.Close()
	eth, err := h.LinkByName("eth0")
	if err != nil {
		return guestIdentity{}, fmt.Errorf("microvm: eth0 in %s: %w", nsPath, err)
	}
	return guestIdentity{Addr: netip.PrefixFrom(ip, prefix), Gateway: gw, MAC: eth.Attrs().HardwareAddr.String()}, nil
}
