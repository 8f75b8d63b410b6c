package microvm

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"time"

	"github.com/aenv-dev/aenv/internal/dataplane"
	"github.com/aenv-dev/aenv/internal/rootfs"
	"github.com/aenv-dev/aenv/internal/sandbox"
	"github.com/aenv-dev/aenv/internal/storage/blockdev"
	"github.com/aenv-dev/aenv/internal/vmm"
)

// Reconcile implements sandbox.Backend. It runs once at startup, before any Launch.
//
// A VM of a known id is adopted when everything it runs on survived the previous process:
// its QEMU (found by the pidfile in its directory, verified to be that QEMU by its command
// line, its monitor reconnected), its root disk (still served by the data plane, and the
// very file QEMU's drive names) and its network slot (kept with its tap, which QEMU holds,
// and its egress rules). A VM the crash caught in a capture is brought back to running:
// a migration in flight is cancelled, a RAM file a pause had moved into its capture is
// moved back, and a stopped guest continues (adopt.go).
//
// Everything else an earlier run left is removed: QEMU processes (killed by pid), the
// disks (closed in the data plane, or their dead FUSE mounts aborted and unmounted), RAM
// files, sandbox directories and network slots. Without a data plane no VM can be
// adopted: its disk was served by the previous process, whose FUSE connection died
// with it.
func (b *Backend) Reconcile(ctx context.Context, known []string) (map[string]sandbox.Instance, error) {
	want := map[string]bool{}
	for _, id := range known {
		want[id] = true
	}
	disks, err := b.dataPlaneDisks(ctx)
	if err != nil {
		// Without the list no disk can be adopted, and none may be closed either: it may
		// serve a VM that runs. Fail the start rather than lose the sandboxes.
		return nil, fmt.Errorf("microvm: reconcile: list the data plane's disks: %w", err)
	}
	ents, err := os.ReadDir(b.cfg.sandboxesDir())
	if err != nil {
		return nil, fmt.Errorf("microvm: list sandboxes: %w", err)
	}
	b.mu.Lock()
	live := map[string]bool{}
	for id := range b.instances {
		live[id] = true
	}
	b.mu.Unlock()
	var errs []error
	adopted := map[string]*Instance{}
	states := map[string]savedState{}
	seen := map[string]bool{} // disk dirs of sandbox directories
	for _, e := range ents {
		if live[e.Name()] || !e.IsDir() {
			continue
		}
		dir := filepath.Join(b.cfg.sandboxesDir(), e.Name())
		seen[dir] = true
		inst, st, err := b.adopt(ctx, e.Name(), want, disks)
		if err == nil && adopted[inst.id] != nil {
			err = fmt.Errorf("a second directory claims sandbox %s", inst.id)
			inst.proc.m.QMP().Close()
		}
		if err == nil {
			adopted[inst.id], states[inst.id] = inst, st
			continue
		}
		if want[e.Name()] {
			b.log.Warn("microvm: reconcile: cannot adopt the sandbox; removing it", "id", e.Name(), "err", err)
		}
		errs = append(errs, b.removeLeft(ctx, dir, disks))
	}
	// Disks the data plane serves for directories that are gone.
	for dir := range disks {
		if !seen[dir] {
			errs = append(errs, b.closeDisk(ctx, dir))
		}
	}
	b.mu.Lock()
	for id, inst := range adopted {
		b.instances[id] = inst
		live[id] = true
	}
	b.mu.Unlock()
	errs = append(errs, b.sweepRAM(live))
	// Every slot of this prefix that no live or adopted instance holds goes (a VM's tap
	// goes with its QEMU; the slot's namespace with the redirects goes here).
	keep := b.liveSlots()
	for _, st := range states {
		keep[st.SlotIndex] = st.AllowInternet
	}
	slots, err := b.pool.Reconcile(ctx, keep)
	errs = append(errs, err)
	alive := map[string]sandbox.Instance{}
	for id, inst := range adopted {
		slot := slots[states[id].SlotIndex]
		if slot == nil {
			b.log.Warn("microvm: reconcile: adopted sandbox lost its network slot; removing it", "id", id)
			errs = append(errs, inst.Stop(ctx))
			continue
		}
		inst.mu.Lock()
		inst.slot = slot
		inst.mu.Unlock()
		alive[id] = inst
		b.log.Info("microvm: adopted a running sandbox", "id", id, "pid", inst.PID(), "slot", slot.Index)
	}
	return alive, errors.Join(errs...)
}

// removeLeft removes a sandbox directory an earlier run left, and everything it held.
func (b *Backend) removeLeft(ctx context.Context, dir string, disks map[string]dataplane.Info) error {
	_, served := disks[dir]
	if !served {
		// A disk of the previous process: its FUSE connection goes first, since a QEMU
		// blocked on its dead server could not die of SIGKILL until it is aborted.
		if err := blockdev.Sweep(ctx, dir); err != nil {
			return err
		}
	}
	if err := vmm.KillPIDFile(filepath.Join(dir, pidFileName)); err != nil {
		return err // its files stay for the next start
	}
	if served {
		if err := b.closeDisk(ctx, dir); err != nil {
			return err
		}
	}
	b.log.Info("microvm: removed a sandbox left by an earlier run", "dir", dir)
	return os.RemoveAll(dir)
}

// closeDisk stops the data plane serving the disk of a sandbox that is gone. A disk still
// held (the killed QEMU not yet fully exited: seen in a CI run) is no failure: the data
// plane stops serving it once that holder lets go (blockdev.ErrStillInUse).
func (b *Backend) closeDisk(ctx context.Context, dir string) error {
	err := b.cfg.DataPlane.Close(ctx, dir)
	if errors.Is(err, blockdev.ErrStillInUse) {
		b.log.Info("microvm: the disk of a removed sandbox is still held; the data plane closes it when released", "dir", dir)
		return nil
	}
	if err != nil && !errors.Is(err, dataplane.ErrNotFound) {
		return fmt.Errorf("microvm: close the disk of %s: %w", dir, err)
	}
	return nil
}

// sweepRAM removes RAM files of sandboxes that are not live.
func (b *Backend) sweepRAM(live map[string]bool) error {
	ents, err := os.ReadDir(b.cfg.RAMDir)
	if err != nil {
		return fmt.Errorf("microvm: list RAM files: %w", err)
	}
	var errs []error
	for _, e := range ents {
		id, ok := strings.CutSuffix(e.Name(), ".ram")
		if !ok || live[id] {
			continue
		}
		if err := os.Remove(filepath.Join(b.cfg.RAMDir, e.Name())); err != nil && !errors.Is(err, os.ErrNotExist) {
			errs = append(errs, err)
		}
	}
	return errors.Join(errs...)
}

func (b *Backend) liveSlots() map[int]bool {
	b.mu.Lock()
	defer b.mu.Unlock()
	keep := map[int]bool{}
	for _, i := range b.instances {
		i.mu.Lock()
		if i.slot != nil {
			keep[i.slot.Index] = i.slot.AllowInternet
		}
		i.mu.Unlock()
	}
	return keep
}

// adoptTimeout bounds the monitor work of one adoption (reconnect, settle a capture).
const adoptTimeout = 10 * time.Second

// adopt takes over the VM in the sandbox directory id if it is known and everything it
// runs on survived; see Reconcile. On error nothing was changed that removeLeft does not
// undo.
//
// The directory of a VM the snapshot pool handed out (pool.go) is named for the pool; its
// state file names the sandbox.
func (b *Backend) adopt(ctx context.Context, name string, want map[string]bool, disks map[string]dataplane.Info) (*Instance, savedState, error) {
	dir := filepath.Join(b.cfg.sandboxesDir(), name)
	id := name
	if pooledDir(name) {
		st, err := readState(filepath.Join(dir, stateFile))
		if err != nil {
			return nil, st, err
		}
		id = st.ID
	}
	if !want[id] {
		return nil, savedState{}, errors.New("unknown to the orchestrator")
	}
	st, err := readState(filepath.Join(dir, stateFile))
	if err != nil {
		return nil, st, err
	}
	if st.ID != id || !within(st.RAMFile, b.cfg.RAMDir) {
		return nil, st, fmt.Errorf("state file %+v does not match the directory", st)
	}
	info, ok := disks[dir]
	if !ok {
		return nil, st, errors.New("no data plane serves its root disk any more")
	}
	ctx, cancel := context.WithTimeout(ctx, adoptTimeout)
	defer cancel()
	m, err := vmm.Adopt(ctx, filepath.Join(dir, pidFileName), filepath.Join(dir, qmpSock))
	if err != nil {
		return nil, st, err
	}
	inst, err := b.adoptMachine(ctx, m, st, dir, info)
	if err != nil {
		m.QMP().Close() // removeLeft kills it
		return nil, st, err
	}
	return inst, st, nil
}

// adoptMachine checks that the adopted QEMU runs on the disk the data plane serves,
// settles a capture the crash interrupted, and makes the Instance.
func (b *Backend) adoptMachine(ctx context.Context, m *vmm.Machine, st savedState, dir string, info dataplane.Info) (*Instance, error) {
	// Its root drive is a path, or (confined) descriptors: either way QEMU holds the file.
	if _, ok := vmm.ArgValue(m.Args(), "-drive", "id=root,"); !ok || !holdsFile(m.PID(), info.Path) {
		return nil, fmt.Errorf("QEMU %d does not run on the data plane's disk %s", m.PID(), info.Path)
	}
	if err := b.settle(ctx, m, st); err != nil {
		return nil, fmt.Errorf("QEMU %d: %w", m.PID(), err)
	}
	inst := &Instance{
		b: b, id: st.ID, dir: dir, ramFile: st.RAMFile, res: st.Resources, started: st.Started, adopted: true,
		disk: rootfs.AdoptDisk(b.cfg.DataPlane.Attach(info)),
		proc: &vmProc{pid: m.PID(), m: m, done: m.Exited()},
		mem:  memState{privateRAM: st.PrivateRAM, guest: st.Guest},
	}
	return inst, nil
}
