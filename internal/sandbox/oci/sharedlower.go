package oci

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"

	"github.com/aenv-dev/aenv/internal/dataplane"
	"github.com/aenv-dev/aenv/internal/rootfs"
	"github.com/aenv-dev/aenv/internal/storage/blockdev"
	"github.com/aenv-dev/aenv/internal/storage/stack"
	"golang.org/x/sys/unix"
)

// Overlay roots over shared lowers (Config.OverlayRoots, package rootfs): a sandbox's
// root is an overlay whose lower is its template's (or snapshot's) sealed layers, mounted
// read-only once per node and shared by every sandbox on them, and whose upper is a block
// root of its own. The template's files are then read through FUSE and cached once per
// node instead of once per sandbox. A snapshot of such a root seals its upper: the
// capture lists the lower's layers (Captured.Layers) and the upper's (Captured.Upper),
// and a launch from it opens the upper's layers over the same lower. A capture with an
// upper always launches on an overlay root; a capture without one launches on a block
// root, or, with OverlayRoots, on an overlay over its layers (a lower shared by the
// capture's children).

// diskRoot is a sandbox's root on sealed layers: a block root of its own (blockRoot) or an
// overlay root over a shared lower (overlayRoot).
type diskRoot interface {
	// seal seals what the root wrote into a new layer at output (see rootfs.Block.Snapshot)
	// and returns the capture's stack: the layers the root was opened on (a block root's
	// with the new one last) and an overlay root's upper layers (the new one last).
	seal(ctx context.Context, output string, q rootfs.Quiesce) (layers, upper []stack.LayerRef, t rootfs.SnapshotTimes, err error)
	// size is the device size of the root's writable filesystem in bytes.
	size() int64
	// files lists the layer files the root holds, for the collection of unused ones.
	files() []stack.LayerRef
	// DropSyncs, Close and OutOfProcess are rootfs.Block's, for the writable filesystem.
	DropSyncs() error
	Close() error
	OutOfProcess() bool
}

var (
	_ diskRoot = blockRoot{}
	_ diskRoot = overlayRoot{}
)

// blockRoot is a root on a block device of its own.
type blockRoot struct{ *rootfs.Block }

func (r blockRoot) seal(ctx context.Context, output string, q rootfs.Quiesce) ([]stack.LayerRef, []stack.LayerRef, rootfs.SnapshotTimes, error) {
	layers, t, err := r.Snapshot(ctx, output, q)
	return layers, nil, t, err
}

func (r blockRoot) size() int64             { return r.Size() }
func (r blockRoot) files() []stack.LayerRef { return r.Lowers() }

// overlayRoot is an overlay root over a shared lower of layers lower.
type overlayRoot struct {
	*rootfs.Overlay
	lower []stack.LayerRef
}

func (r overlayRoot) seal(ctx context.Context, output string, q rootfs.Quiesce) ([]stack.LayerRef, []stack.LayerRef, rootfs.SnapshotTimes, error) {
	upper, t, err := r.Snapshot(ctx, output, q)
	return r.lower, upper, t, err
}

func (r overlayRoot) size() int64 {
	if u := r.Upper(); u != nil {
		return u.Size()
	}
	return 0
}

func (r overlayRoot) files() []stack.LayerRef {
	out := append([]stack.LayerRef(nil), r.lower...)
	if u := r.Upper(); u != nil {
		out = append(out, u.Lowers()...)
	}
	return out
}

func (r overlayRoot) DropSyncs() error {
	if u := r.Upper(); u != nil {
		return u.DropSyncs()
	}
	return nil
}

func (r overlayRoot) OutOfProcess() bool {
	u := r.Upper()
	return u != nil && u.OutOfProcess()
}

// upperRef is an overlay root's upper layer in a capture. Its role keeps the snapshot
// publisher (which finds layers in any artifact by their fields, see
// snapshot.ArtifactLayers) from stacking it with the capture's Layers, a stack of its own.
type upperRef struct {
	stack.LayerRef
	Role string `json:"role"`
}

// upperRole is upperRef.Role.
const upperRole = "upper"

func toUpperRefs(ls []stack.LayerRef) []upperRef {
	if len(ls) == 0 {
		return nil
	}
	out := make([]upperRef, len(ls))
	for n, l := range ls {
		out[n] = upperRef{LayerRef: l, Role: upperRole}
	}
	return out
}

// withUpper lists an overlay root's layer files: layers (its lower's), then upper's,
// without writing into layers' backing array.
func withUpper(layers, upper []stack.LayerRef) []stack.LayerRef {
	return append(layers[:len(layers):len(layers)], upper...)
}

func fromUpperRefs(us []upperRef) []stack.LayerRef {
	if len(us) == 0 {
		return nil
	}
	out := make([]stack.LayerRef, len(us))
	for n, u := range us {
		out[n] = u.LayerRef
	}
	return out
}

func (b *Backend) lowersDir() string { return filepath.Join(b.cfg.DataDir, "lowers") }
func (b *Backend) uppersDir() string { return filepath.Join(b.cfg.DataDir, "uppers") }

// mountOverlay opens inst's overlay root at its rootfs directory over the shared lower of
// o.layers, with o.upper as its upper's layers (an empty upper as large as the device
// when there are none), id-mapped to userns (the one of inst's id map).
func (b *Backend) mountOverlay(ctx context.Context, inst *Instance, o createOpts, userns int) error {
	lower, err := b.lowers.Acquire(ctx, o.layers)
	if err != nil {
		return fmt.Errorf("oci: overlay root: %w", err)
	}
	// The root takes a use of its own.
	defer func() {
		if err := b.lowers.Release(lower); err != nil {
			b.log.Warn("oci: release a shared lower", "lower", lower.Path(), "err", err)
		}
	}()
	upper := o.upper
	if len(upper) == 0 {
		size := o.vsize
		if size == 0 {
			size = uint64(lower.Size())
		}
		empty, err := rootfs.EmptyUpper(ctx, b.uppersDir(), int(max((size+1<<20-1)>>20, 64)))
		if err != nil {
			return fmt.Errorf("oci: overlay root: %w", err)
		}
		upper = []stack.LayerRef{empty}
	}
	inst.mu.Lock()
	rootID := inst.idmap.rootID()
	inst.mu.Unlock()
	ovl, err := b.lowers.OpenOverlay(ctx, rootfs.OverlaySpec{
		Dir: inst.l.dir, Lower: lower, Upper: upper, VirtualSize: o.vsize, Target: inst.l.rootfs(),
		UserNS: userns, RootID: rootID, Open: b.diskOpener(), Resolver: b.cfg.LayerResolver,
	})
	if err != nil {
		return fmt.Errorf("oci: overlay root: %w", err)
	}
	inst.mu.Lock()
	inst.root = overlayRoot{Overlay: ovl, lower: o.layers}
	inst.mu.Unlock()
	return nil
}

// adoptLowers takes over the shared lowers the data plane still serves (disks under
// lowersDir); each is held once until releaseLowers, so that the overlay roots adopted
// meanwhile find them. A lower that cannot be adopted is left to the sweep.
func (b *Backend) adoptLowers(disks map[string]dataplane.Info, mounts blockdev.Mounts) map[string]*rootfs.SharedLower {
	out := map[string]*rootfs.SharedLower{}
	for dir, info := range disks {
		if filepath.Dir(dir) != b.lowers.Dir() {
			continue
		}
		l, err := b.lowers.Adopt(b.cfg.DataPlane.Attach(info), mounts)
		if err != nil {
			b.log.Warn("oci: reconcile: cannot adopt a shared lower; removing it", "dir", dir, "err", err)
			continue
		}
		out[l.Path()] = l
	}
	return out
}

// adoptOverlay takes over the overlay root of a running container whose saved state says
// it is over the lower mounted at st.Lower; upper is the data plane's disk of its upper.
func (b *Backend) adoptOverlay(inst *Instance, st savedState, lowers map[string]*rootfs.SharedLower, upper dataplane.Info, mounts blockdev.Mounts) error {
	lower := lowers[st.Lower]
	if lower == nil {
		return fmt.Errorf("oci: its shared lower %s was not adopted", st.Lower)
	}
	ovl, err := b.lowers.AdoptOverlay(rootfs.OverlaySpec{Dir: inst.l.dir, Target: inst.l.rootfs(), Lower: lower},
		b.cfg.DataPlane.Attach(upper), mounts)
	if err != nil {
		return err
	}
	inst.root = overlayRoot{Overlay: ovl, lower: st.LowerLayers}
	return nil
}

// releaseLowers gives back adoptLowers' hold on each lower: those no overlay root was
// adopted over are unmounted and their disks closed.
func (b *Backend) releaseLowers(lowers map[string]*rootfs.SharedLower) error {
	var errs []error
	for _, l := range lowers {
		if err := b.lowers.Release(l); err != nil {
			errs = append(errs, err)
		}
	}
	return errors.Join(errs...)
}

// sweepLowers removes what is left of the shared lowers other than those in keep (their
// directories): mounts and loop devices of a previous process's lowers that were not
// adopted (rootfs.Sweep), then their directories.
func (b *Backend) sweepLowers(ctx context.Context, keep []string) error {
	dir := b.lowers.Dir()
	errs := []error{rootfs.Sweep(ctx, dir, keep...)}
	ents, err := os.ReadDir(dir)
	if err != nil && !errors.Is(err, os.ErrNotExist) {
		errs = append(errs, fmt.Errorf("oci: shared lowers: %w", err))
	}
	kept := map[string]bool{}
	for _, k := range keep {
		kept[k] = true
	}
	for _, e := range ents {
		p := filepath.Join(dir, e.Name())
		if kept[p] {
			continue
		}
		// Never into a filesystem the sweep could not unmount.
		if mounted, _, err := mountRoot(filepath.Join(p, "root")); err != nil && !errors.Is(err, os.ErrNotExist) || mounted {
			errs = append(errs, fmt.Errorf("oci: shared lower %s still mounted after the sweep: %v", p, err))
			continue
		}
		errs = append(errs, os.RemoveAll(p))
	}
	return errors.Join(errs...)
}

// detachOverlays detaches the overlay roots (and their views of shared lowers) of the
// bundles whose containers were not adopted (orphans): each holds its upper's filesystem
// and its lower's, whose disks are closed next. Call it after rootfs.Sweep: an overlay's
// unmount syncs its upper, which waits forever on a FUSE connection whose server died
// unless the sweep aborted it.
func (b *Backend) detachOverlays(orphans []layout, mounts blockdev.Mounts) error {
	var errs []error
	for _, l := range orphans {
		for p, fstype := range map[string]string{l.rootfs(): "overlay", filepath.Join(l.dir, "lower"): "ext4"} {
			if mounts.FSType(absDir(p)) != fstype {
				continue
			}
			if err := unix.Unmount(p, unix.MNT_DETACH); err != nil && !errors.Is(err, unix.EINVAL) && !errors.Is(err, unix.ENOENT) {
				errs = append(errs, fmt.Errorf("oci: detach %s: %w", p, err))
			}
		}
	}
	return errors.Join(errs...)
}

// overlay says whether o's root on layers is an overlay root, on a node that makes them
// (overlayRoots) or not: always over a capture's upper, never for a flat root.
func (o createOpts) overlay(overlayRoots bool) bool {
	return len(o.upper) > 0 || overlayRoots && !o.flat
}
