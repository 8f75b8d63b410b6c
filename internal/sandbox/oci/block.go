package oci

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"time"

	"github.com/aenv-dev/aenv/internal/rootfs"
	"github.com/aenv-dev/aenv/internal/sandbox"
	"github.com/aenv-dev/aenv/internal/storage/stack"
	"golang.org/x/sys/unix"
)

// Layered block roots, snapshots and forks.
//
// A sandbox on a block root owns a writable upper in its bundle; the sealed lowers are
// shared. A snapshot seals the upper into DataDir/layers/<capture id>.commit (a rename on
// the same filesystem, no copy) and records the capture in DataDir/captures/<id>.json.
// Layer files under DataDir/layers are deleted once neither a live root nor a capture
// record lists them (gcLayers); layers outside it (templates) are never deleted here.

// captureVersion is the Captured format version.
const captureVersion = 1

// Captured is this backend's sandbox.Captured: the sealed layers of a sandbox's root
// filesystem at the time of the snapshot (processes and memory are not captured).
type Captured struct {
	Version int    `json:"version"`
	Backend string `json:"backend"`
	ID      string `json:"id"`
	// SourceID is the sandbox the capture was taken from.
	SourceID string `json:"sourceSandboxID"`
	// Layers are the root's sealed layers, bottom first; for a block root the last one is
	// new. For an overlay root they are its shared lower's, and Upper are its upper's,
	// the new one last.
	Layers      []stack.LayerRef  `json:"layers"`
	Upper       []upperRef        `json:"upper,omitempty"`
	VirtualSize uint64            `json:"virtualSize"`
	Resources   sandbox.Resources `json:"resources"`
	CreatedAt   time.Time         `json:"createdAt"`
	// FrozenMicros is how long the source's filesystem was frozen, TotalMicros the
	// whole capture.
	FrozenMicros int64 `json:"frozenMicros"`
	TotalMicros  int64 `json:"totalMicros"`
}

var _ sandbox.Captured = (*Captured)(nil)

// files lists every layer file the capture names: Layers, then Upper.
func (c *Captured) files() []stack.LayerRef {
	return withUpper(c.Layers, fromUpperRefs(c.Upper))
}

// Encode implements sandbox.Captured.
func (c *Captured) Encode() ([]byte, error) { return json.Marshal(c) }

func (c *Captured) validate() error {
	if c.Version != captureVersion || c.Backend != "oci" || !idRE.MatchString(c.ID) {
		return fmt.Errorf("oci: not a capture of this backend (version %d, backend %q, id %q)", c.Version, c.Backend, c.ID)
	}
	if len(c.Layers) == 0 {
		return fmt.Errorf("oci: capture %s has no layers", c.ID)
	}
	for _, l := range c.files() {
		if err := checkLayer(l); err != nil {
			return fmt.Errorf("oci: capture %s: %w", c.ID, err)
		}
	}
	for _, u := range c.Upper {
		if u.Role != upperRole {
			return fmt.Errorf("oci: capture %s: upper layer with role %q", c.ID, u.Role)
		}
	}
	return nil
}

// checkLayer accepts a layer with an absolute path, or one with only a digest (opened
// through Config.LayerResolver).
func checkLayer(l stack.LayerRef) error {
	if l.Path == "" && l.Digest != "" || filepath.IsAbs(l.Path) {
		return nil
	}
	return fmt.Errorf("layer %+v has neither an absolute path nor a digest", l)
}

// DecodeCaptured implements sandbox.Backend. The capture's layer files must still exist.
func (b *Backend) DecodeCaptured(raw []byte) (sandbox.Captured, error) {
	c := &Captured{}
	if err := json.Unmarshal(raw, c); err != nil {
		return nil, fmt.Errorf("oci: decode capture: %w", err)
	}
	if err := c.validate(); err != nil {
		return nil, err
	}
	for _, l := range c.files() {
		if l.Path == "" {
			continue // resolved by digest at launch
		}
		if _, err := os.Stat(l.Path); err != nil {
			return nil, fmt.Errorf("oci: capture %s: layer missing: %w", c.ID, err)
		}
	}
	return c, nil
}

func (b *Backend) layersDir() string   { return filepath.Join(b.cfg.DataDir, "layers") }
func (b *Backend) capturesDir() string { return filepath.Join(b.cfg.DataDir, "captures") }

// layerRefs converts the seam's layer refs to the storage engine's.
func layerRefs(in []sandbox.LayerRef) []stack.LayerRef {
	out := make([]stack.LayerRef, len(in))
	for n, l := range in {
		out[n] = stack.LayerRef{Path: l.Path, Digest: l.Digest, Size: l.Size, UUID: l.UUID}
	}
	return out
}

// launchBlock creates sandbox plan.SandboxID on a fresh upper over layers (over upper,
// an overlay root's upper layers, when there are any: see sharedlower.go). The device is
// vsize bytes, or Resources.DiskSizeMB when that is larger (the filesystem is grown).
func (b *Backend) launchBlock(ctx context.Context, plan sandbox.LaunchPlan, layers, upper []stack.LayerRef, vsize uint64) (sandbox.Instance, error) {
	for _, l := range withUpper(layers, upper) {
		if err := checkLayer(l); err != nil {
			return nil, fmt.Errorf("oci: %w", err)
		}
		if l.Path == "" && b.cfg.LayerResolver == nil {
			return nil, fmt.Errorf("oci: layer %s has no path and no LayerResolver is configured", l.Digest)
		}
	}
	if want := uint64(plan.Resources.DiskSizeMB) << 20; vsize > 0 && want > vsize {
		vsize = want
	}
	inst, err := b.reserve(plan)
	if err != nil {
		return nil, err
	}
	root := createOpts{layers: layers, upper: upper, vsize: vsize, flat: plan.FlatRoot && len(upper) == 0}
	if root.flat && b.cfg.OverlayRoots {
		// Not from the template's pool, whose containers are on overlay roots.
		return b.launchWarmOrNew(ctx, inst, plan, "", root)
	}
	if plan.Kind == sandbox.LaunchFresh || plan.SnapshotTemplate {
		// Templates (snapshot templates too) are launched again and again; a fork's or a
		// pause's capture once per child or resume.
		return b.launchWarmOrNew(ctx, inst, plan, blockKey(layers, upper, vsize), root)
	}
	return b.launchWarmOrNew(ctx, inst, plan, "", root)
}

// blockKey names a layered root in the warm pool.
func blockKey(layers, upper []stack.LayerRef, vsize uint64) string {
	var k strings.Builder
	k.WriteString("layers")
	for _, l := range layers {
		k.WriteString(":" + l.Path + "#" + l.Digest)
	}
	if len(upper) > 0 {
		k.WriteString("+upper")
		for _, l := range upper {
			k.WriteString(":" + l.Path + "#" + l.Digest)
		}
	}
	return fmt.Sprintf("%s@%d", k.String(), vsize)
}

// mountBlock opens inst's root on o.layers at its rootfs directory, id-mapped to userns:
// an overlay root when o has upper layers or the node makes overlay roots, else a block
// root.
func (b *Backend) mountBlock(ctx context.Context, inst *Instance, o createOpts, userns int) error {
	if o.overlay(b.cfg.OverlayRoots) {
		return b.mountOverlay(ctx, inst, o, userns)
	}
	blk, err := rootfs.Open(ctx, rootfs.Spec{
		Dir: inst.l.dir, Lowers: o.layers, VirtualSize: o.vsize, Target: inst.l.rootfs(), UserNS: userns,
		Resolver: b.cfg.LayerResolver, Open: b.diskOpener(),
	})
	if err != nil {
		return fmt.Errorf("oci: block root: %w", err)
	}
	inst.mu.Lock()
	inst.root = blockRoot{blk}
	inst.mu.Unlock()
	return nil
}

func (i *Instance) isBlock() bool {
	i.mu.Lock()
	defer i.mu.Unlock()
	return i.root != nil
}

// Snapshot implements sandbox.Instance: the root filesystem is frozen for the seal of its
// upper (the sandbox keeps running, same id) and the sealed layers are returned. Only
// sandboxes on block roots can snapshot. A failure after the seal is terminal (ErrGone).
func (i *Instance) Snapshot(ctx context.Context) (sandbox.Captured, error) {
	i.snapMu.Lock()
	defer i.snapMu.Unlock()
	return i.snapshot(ctx)
}

func (i *Instance) snapshot(ctx context.Context) (*Captured, error) {
	if err := i.live(); err != nil {
		return nil, err
	}
	i.mu.Lock()
	blk := i.root
	i.mu.Unlock()
	if blk == nil {
		return nil, fmt.Errorf("%w: snapshot of a sandbox on a directory template (only layered templates can snapshot)", ErrUnsupported)
	}
	id, err := newCaptureID()
	if err != nil {
		return nil, err
	}
	b := i.b
	b.layersMu.Lock()
	defer b.layersMu.Unlock()
	for _, d := range []string{b.layersDir(), b.capturesDir()} {
		if err := os.MkdirAll(d, 0o700); err != nil {
			return nil, fmt.Errorf("oci: snapshot: %w", err)
		}
	}
	q := rootfs.QuiesceFreeze
	if b.cfg.SnapshotQuiesce == QuiesceSync {
		q = rootfs.QuiesceSync
	}
	lowers, upper, times, err := blk.seal(ctx, filepath.Join(b.layersDir(), id+".commit"), q)
	if errors.Is(err, stack.ErrBroken) {
		return nil, fmt.Errorf("%w: %s: root filesystem lost in a failed snapshot: %w", sandbox.ErrGone, i.id, err)
	}
	if err != nil {
		return nil, fmt.Errorf("oci: snapshot %s: %w", i.id, err)
	}
	c := &Captured{
		Version: captureVersion, Backend: "oci", ID: id, SourceID: i.id, Layers: lowers, Upper: toUpperRefs(upper),
		VirtualSize: uint64(blk.size()), Resources: i.res, CreatedAt: time.Now().UTC(),
		FrozenMicros: times.Frozen.Microseconds(), TotalMicros: times.Total.Microseconds(),
	}
	// The record keeps the layers from the collector until DiscardSnapshot. The sealed
	// layer is also in the live root's lowers, so a failure here loses nothing.
	if err := writeCapture(b.capturePath(id), c); err != nil {
		return nil, err
	}
	b.log.Debug("oci: snapshot", "id", i.id, "capture", id, "layers", len(lowers),
		"sync", times.Sync, "frozen", times.Frozen, "freeze", times.Freeze, "seal", times.Seal,
		"durable", times.Durable, "total", times.Total)
	return c, nil
}

func (b *Backend) capturePath(id string) string { return filepath.Join(b.capturesDir(), id+".json") }

func writeCapture(path string, c *Captured) error {
	raw, err := json.Marshal(c)
	if err != nil {
		return fmt.Errorf("oci: encode capture: %w", err)
	}
	tmp := path + ".tmp"
	if err := os.WriteFile(tmp, raw, 0o600); err != nil {
		return fmt.Errorf("oci: write capture: %w", err)
	}
	if err := os.Rename(tmp, path); err != nil {
		os.Remove(tmp)
		return fmt.Errorf("oci: write capture: %w", err)
	}
	return nil
}

func newCaptureID() (string, error) {
	var r [12]byte
	if _, err := rand.Read(r[:]); err != nil {
		return "", fmt.Errorf("oci: capture id: %w", err)
	}
	return "cap-" + hex.EncodeToString(r[:]), nil
}

// forkParallelism bounds concurrent child launches of one Fork.
const forkParallelism = 4

// Fork implements sandbox.Instance: one snapshot, then one sandbox per spec on a fresh
// upper over the snapshot's layers, with fresh processes (this backend does not capture
// memory). The capture is discarded afterwards; the children keep its layers in use.
func (i *Instance) Fork(ctx context.Context, specs []sandbox.ForkSpec) ([]sandbox.ForkResult, error) {
	c, err := i.Snapshot(ctx)
	if err != nil {
		return nil, err
	}
	out := make([]sandbox.ForkResult, len(specs))
	var wg sync.WaitGroup
	sem := make(chan struct{}, forkParallelism)
	for n, spec := range specs {
		wg.Add(1)
		sem <- struct{}{}
		go func() {
			defer func() { <-sem; wg.Done() }()
			inst, err := i.b.Launch(ctx, sandbox.LaunchPlan{
				Kind: sandbox.LaunchFromSnapshot, SandboxID: spec.SandboxID, Resources: spec.Resources,
				AllowInternet: i.allowInternet, Snapshot: c,
			})
			out[n] = sandbox.ForkResult{Instance: inst, Err: err}
		}()
	}
	wg.Wait()
	if err := i.b.DiscardSnapshot(context.WithoutCancel(ctx), c); err != nil {
		i.b.log.Warn("oci: discard fork capture", "id", i.id, "err", err)
	}
	return out, nil
}

// pauseToDisk snapshots the sandbox and stops it.
func (i *Instance) pauseToDisk(ctx context.Context) (sandbox.PausedState, error) {
	i.snapMu.Lock()
	c, err := i.snapshot(ctx)
	i.snapMu.Unlock()
	if err != nil {
		return nil, err
	}
	if err := i.Stop(ctx); err != nil {
		// Stop ran every step it could; the sandbox cannot run on, but its capture is
		// complete, so the pause itself holds.
		i.b.log.Warn("oci: stop after pause to disk", "id", i.id, "err", err)
	}
	return pausedState{ID: i.id, Disk: c}, nil
}

// DiscardSnapshot tells the backend the orchestrator no longer references c (snapshot
// deleted, fork done, sandbox resumed or killed while paused to disk). Its record goes,
// and with it every layer no live root or other capture uses.
func (b *Backend) DiscardSnapshot(ctx context.Context, c sandbox.Captured) error {
	cc, ok := c.(*Captured)
	if !ok || cc == nil {
		return fmt.Errorf("oci: discard: capture is %T, not this backend's", c)
	}
	return b.discardCapture(ctx, cc)
}

// DiscardPaused drops what a sandbox paused to disk holds (its capture), for a kill of
// the paused sandbox. Pauses in place hold nothing outside the instance.
func (b *Backend) DiscardPaused(ctx context.Context, _ string, ps sandbox.PausedState) error {
	if p, ok := ps.(pausedState); ok && p.Disk != nil {
		return b.discardCapture(ctx, p.Disk)
	}
	return nil
}

func (b *Backend) discardCapture(ctx context.Context, c *Captured) error {
	if !idRE.MatchString(c.ID) {
		return fmt.Errorf("oci: discard: bad capture id %q", c.ID)
	}
	// Warm containers of a snapshot template hold its layers open (and would keep the
	// space of the files gcLayers deletes); its top layer is its own (its upper's top
	// for an overlay root's).
	own, n := c.Layers, len(c.Layers)
	if len(c.Upper) > 0 {
		own, n = fromUpperRefs(c.Upper), len(c.Upper)
	}
	if n > 0 && b.warm != nil {
		top := own[n-1]
		if err := b.warm.forget(ctx, func(o createOpts) bool { return hasLayer(o.layers, top) || hasLayer(o.upper, top) }); err != nil {
			return fmt.Errorf("oci: discard capture %s: warm containers: %w", c.ID, err)
		}
	}
	b.layersMu.Lock()
	err := os.Remove(b.capturePath(c.ID))
	b.layersMu.Unlock()
	if err != nil && !errors.Is(err, os.ErrNotExist) {
		return fmt.Errorf("oci: discard capture %s: %w", c.ID, err)
	}
	return b.gcLayers()
}

// gcLayers deletes the layer files under DataDir/layers that neither a live block root
// nor a capture record lists.
func (b *Backend) gcLayers() error {
	b.layersMu.Lock()
	defer b.layersMu.Unlock()
	used := map[string]bool{}
	b.mu.Lock()
	var roots []diskRoot
	for _, inst := range b.instances {
		inst.mu.Lock()
		if inst.root != nil {
			roots = append(roots, inst.root)
		}
		inst.mu.Unlock()
	}
	b.mu.Unlock()
	for _, r := range roots {
		for _, l := range r.files() {
			used[l.Path] = true
		}
	}
	ents, err := os.ReadDir(b.capturesDir())
	if err != nil && !errors.Is(err, os.ErrNotExist) {
		return fmt.Errorf("oci: gc: %w", err)
	}
	for _, e := range ents {
		if !strings.HasSuffix(e.Name(), ".json") {
			continue
		}
		var c Captured
		raw, err := os.ReadFile(filepath.Join(b.capturesDir(), e.Name()))
		if err == nil {
			err = json.Unmarshal(raw, &c)
		}
		if err != nil {
			// An unreadable record might list anything: keep every layer this round.
			return fmt.Errorf("oci: gc: capture %s: %w", e.Name(), err)
		}
		for _, l := range c.files() {
			used[l.Path] = true
		}
	}
	ents, err = os.ReadDir(b.layersDir())
	if err != nil && !errors.Is(err, os.ErrNotExist) {
		return fmt.Errorf("oci: gc: %w", err)
	}
	var errs []error
	for _, e := range ents {
		p := filepath.Join(b.layersDir(), e.Name())
		if used[p] {
			continue
		}
		if err := os.Remove(p); err != nil && !errors.Is(err, os.ErrNotExist) {
			errs = append(errs, fmt.Errorf("oci: gc: %w", err))
			continue
		}
		b.log.Debug("oci: layer removed", "path", p)
	}
	return errors.Join(errs...)
}

// onLayersIn reports whether any of lowers is a file directly in dir.
func onLayersIn(lowers []stack.LayerRef, dir string) bool {
	for _, l := range lowers {
		if filepath.Dir(l.Path) == filepath.Clean(dir) {
			return true
		}
	}
	return false
}

// fsUsage is the used and total bytes of the filesystem mounted at dir.
func fsUsage(dir string) (used, total int64) {
	var st unix.Statfs_t
	if err := unix.Statfs(dir, &st); err != nil {
		return 0, 0
	}
	total = int64(st.Blocks) * st.Bsize
	return total - int64(st.Bfree)*st.Bsize, total
}
