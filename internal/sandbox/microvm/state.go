package microvm

import (
	"context"
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"syscall"
	"time"

	"github.com/aenv-dev/aenv/internal/dataplane"
	"github.com/aenv-dev/aenv/internal/rootfs"
	"github.com/aenv-dev/aenv/internal/sandbox"
)

// savedState is written into the sandbox directory when the VM gets its network slot
// and again once QEMU runs: what a restart needs to adopt the VM (Reconcile) and what a
// human needs to find its parts.
type savedState struct {
	ID            string            `json:"id"`
	SlotIndex     int               `json:"slotIndex"`
	AllowInternet bool              `json:"allowInternet"`
	Resources     sandbox.Resources `json:"resources"`
	RAMFile       string            `json:"ramFile"`
	Started       time.Time         `json:"started"`
	// PrivateRAM and Guest are the VM's memState (a restored VM's).
	PrivateRAM bool           `json:"privateRam,omitempty"`
	Guest      *guestIdentity `json:"guest,omitempty"`
}

// saveState records inst's state in its directory (atomically: a crash leaves the old
// or the new file).
func (i *Instance) saveState() error {
	i.mu.Lock()
	st := savedState{ID: i.id, Resources: i.res, RAMFile: i.ramFile, Started: i.started,
		PrivateRAM: i.mem.privateRAM, Guest: i.mem.guest}
	if i.slot != nil {
		st.SlotIndex, st.AllowInternet = i.slot.Index, i.slot.AllowInternet
	}
	i.mu.Unlock()
	raw, err := json.Marshal(st)
	if err != nil {
		return fmt.Errorf("microvm: encode state: %w", err)
	}
	path := filepath.Join(i.dir, stateFile)
	tmp := path + ".tmp"
	if err := os.WriteFile(tmp, raw, 0o600); err != nil {
		return fmt.Errorf("microvm: save state: %w", err)
	}
	if err := os.Rename(tmp, path); err != nil {
		return fmt.Errorf("microvm: save state: %w", err)
	}
	return nil
}

func readState(path string) (savedState, error) {
	var st savedState
	raw, err := os.ReadFile(path)
	if err != nil {
		return st, fmt.Errorf("microvm: %w", err)
	}
	if err := json.Unmarshal(raw, &st); err != nil {
		return st, fmt.Errorf("microvm: %s: %w", path, err)
	}
	return st, nil
}

// DataPlane is the client of the data plane the backend serves root disks through
// (*dataplane.Client).
type DataPlane interface {
	Open(ctx context.Context, spec dataplane.Spec) (*dataplane.RemoteDisk, error)
	List(ctx context.Context) ([]dataplane.Info, error)
	Attach(info dataplane.Info) *dataplane.RemoteDisk
	Close(ctx context.Context, dir string) error
}

// diskOpener opens root disks through the data plane when there is one, else nil
// (rootfs serves them in this process).
func (b *Backend) diskOpener() rootfs.Opener {
	return rootfs.RemoteOpener(b.cfg.DataPlane) // a nil DataPlane converts to a nil DiskServer
}

// dataPlaneDisks lists the data plane's disks of this backend's sandboxes by directory;
// nil without a data plane.
func (b *Backend) dataPlaneDisks(ctx context.Context) (map[string]dataplane.Info, error) {
	if b.cfg.DataPlane == nil {
		return nil, nil
	}
	list, err := b.cfg.DataPlane.List(ctx)
	if err != nil {
		return nil, err
	}
	out := map[string]dataplane.Info{}
	for _, d := range list {
		if within(d.Dir, b.cfg.sandboxesDir()) {
			out[d.Dir] = d
		}
	}
	return out, nil
}

// OnDataPlane lists the sandboxes whose root disks the data plane serves: those a crash
// of the data plane takes down (the node's watcher then drops them).
func (b *Backend) OnDataPlane() []string {
	b.mu.Lock()
	defer b.mu.Unlock()
	var ids []string
	for id, inst := range b.instances {
		inst.mu.Lock()
		if inst.disk != nil && inst.disk.OutOfProcess() {
			ids = append(ids, id)
		}
		inst.mu.Unlock()
	}
	return ids
}

// DataPlaneLost implements the node's data-plane watcher hook: the microvm backend keeps
// nothing ready on the data plane's disks (no warm VMs), so there is nothing to drop.
func (b *Backend) DataPlaneLost(context.Context) error { return nil }

// Crash points (debug only): CrashPointEnv set to one of them makes the process kill
// itself with SIGKILL right there, exactly as `kill -9` would. The crash tests use them to
// hit the windows of a capture, too short to hit from outside.
const (
	// CrashPointEnv names the crash point; never set it in production.
	CrashPointEnv = "AENV_DEBUG_MICROVM_CRASH_AT"
	// crashCaptureState: the VM is stopped and its device state written; the disk is not
	// sealed yet.
	crashCaptureState = "capture:state"
	// crashCaptureSealed: the disk's upper is sealed into the capture's layer (now a lower
	// of the running disk); the RAM is not captured and the VM is still stopped.
	crashCaptureSealed = "capture:sealed"
	// crashCaptureRAM: the capture is complete, the VM still stopped (a pause's RAM file
	// has moved into the capture).
	crashCaptureRAM = "capture:ram"
	// crashForkLaunched: a fork's first child runs, the others may not, nothing is
	// registered.
	crashForkLaunched = "fork:launched"
)

// crashPoint kills the process when b.crashAt names point.
func (b *Backend) crashPoint(point string) {
	if b.crashAt == "" || b.crashAt != point {
		return
	}
	b.log.Warn("microvm: crash point reached: killing the process", "point", point)
	_ = syscall.Kill(os.Getpid(), syscall.SIGKILL)
	select {} // SIGKILL cannot be caught
}
