package microvm

import (
	"context"
	"errors"
	"fmt"
	"os"

	"github.com/aenv-dev/aenv/internal/sandbox"
)

// Pause implements sandbox.Instance: a capture that keeps the VM's own RAM file (no
// copy), then the VM ends and its CPU, QEMU memory, disk mount and network slot are
// released. The sandbox resumes through Launch (LaunchResume) with its processes. A pause
// without memory (KeepMemory false) is the same capture: the orchestrator cold-boots it.
func (i *Instance) Pause(ctx context.Context, _ sandbox.PauseOptions) (sandbox.PausedState, error) {
	c, err := i.capture(ctx, capturePause)
	if err != nil {
		return nil, err
	}
	if err := i.Stop(ctx); err != nil {
		// The capture is complete; what Stop left, a retry or Reconcile removes.
		i.b.log.Warn("microvm: stop after pause", "id", i.id, "err", err)
	}
	return c, nil
}

// StopAfterCapture implements sandbox.CapturedStopper.
func (i *Instance) StopAfterCapture(ctx context.Context) error { return i.Stop(ctx) }

var _ sandbox.CapturedStopper = (*Instance)(nil)

var _ sandbox.PausedCapturer = (*Backend)(nil)

// PausedCapture implements sandbox.PausedCapturer: a paused VM is a persistent capture
// with its memory image (its layers and blobs are files in DataDir/captures/<id>), which
// another node restores with its processes once it is published.
func (b *Backend) PausedCapture(ps sandbox.PausedState) (sandbox.Captured, bool) {
	c, ok := ps.(*capture)
	return c, ok && c.Memory != nil
}

// DiscardSnapshot implements sandbox.SnapshotDiscarder: the memory image goes (VMs
// restored from it keep their mapping of the RAM file, which the kernel holds until they
// end). The sealed disk layer stays: sandboxes launched from the capture have it as a
// lower, and nothing tracks them yet.
func (b *Backend) DiscardSnapshot(_ context.Context, c sandbox.Captured) error {
	mc, ok := c.(*capture)
	if !ok {
		return fmt.Errorf("microvm: discard: %T is not a microvm capture", c)
	}
	b.vmpool.drain(mc.ID)
	return removeImage(b, mc)
}

// DiscardPaused implements sandbox.PausedDiscarder: a paused sandbox that will never
// resume loses its memory image and its sealed disk layer (its own: the lower of
// nothing else).
func (b *Backend) DiscardPaused(_ context.Context, _ string, ps sandbox.PausedState) error {
	mc, ok := ps.(*capture)
	if !ok {
		return fmt.Errorf("microvm: discard: %T is not a microvm paused state", ps)
	}
	b.vmpool.drain(mc.ID)
	err := removeImage(b, mc)
	if within(mc.Dir, b.cfg.capturesDir()) {
		err = errors.Join(err, os.RemoveAll(mc.Dir))
	}
	return err
}

// removeImage deletes c's memory image from this node: its files (a persistent image
// shares its directory with the disk layer, which stays), a transient image's directory,
// and the copies fetched from the repository for it.
func removeImage(b *Backend, c *capture) error {
	m := c.Memory
	if m == nil {
		return nil
	}
	var errs []error
	for _, mb := range []*memBlob{m.RAM, &m.State} {
		if mb == nil {
			continue
		}
		if mb.Path != "" && m.Dir != "" && within(mb.Path, m.Dir) {
			errs = append(errs, removeFile(mb.Path))
		}
		if p := b.fetchedPath(mb.Digest); p != "" {
			errs = append(errs, removeFile(p))
		}
	}
	if within(m.Dir, b.cfg.imagesDir()) {
		errs = append(errs, os.RemoveAll(m.Dir))
		// The last image takes the directory with it (RAMDir holds only running VMs' RAM
		// files then); a capture racing this recreates it.
		_ = os.Remove(b.cfg.imagesDir())
	}
	if err := errors.Join(errs...); err != nil {
		return fmt.Errorf("microvm: discard memory image %s: %w", c.ID, err)
	}
	return nil
}

func removeFile(p string) error {
	if err := os.Remove(p); err != nil && !errors.Is(err, os.ErrNotExist) {
		return err
	}
	return nil
}
