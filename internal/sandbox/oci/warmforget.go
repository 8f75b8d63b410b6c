package oci

import (
	"context"
	"errors"
	"os"

	"github.com/aenv-dev/aenv/internal/sandbox"
	"github.com/aenv-dev/aenv/internal/storage/stack"
)

// ForgetTemplate stops at once the warm containers kept for a template root that was
// deleted or replaced: those of its lower directory, or whose layer stack has root's top
// layer (a template's own; lower layers are shared with other templates), and any whose
// files are gone already. Left in the pool until pushed out, they would hold the old
// layers open (deleted files whose space is not freed, FUSE servers, loop devices) and
// a directory template's retired rootfs mounted. The template is no longer wanted warm;
// a later launch of the same root wants it again.
func (b *Backend) ForgetTemplate(ctx context.Context, root sandbox.RootFS) error {
	if b.warm == nil {
		return nil
	}
	var top stack.LayerRef
	if n := len(root.Layers); n > 0 {
		top = layerRefs(root.Layers[n-1:])[0]
	}
	return b.warm.forget(ctx, func(o createOpts) bool {
		switch {
		case root.LowerDir != "" && o.lower == root.LowerDir:
			return true
		case len(root.Layers) > 0 && hasLayer(o.layers, top):
			return true
		}
		return rootGone(o)
	})
}

// hasLayer reports whether layers holds l (same file, or same content by digest).
func hasLayer(layers []stack.LayerRef, l stack.LayerRef) bool {
	for _, x := range layers {
		if l.Path != "" && x.Path == l.Path || l.Digest != "" && x.Digest == l.Digest {
			return true
		}
	}
	return false
}

// rootGone reports whether a warm root's files were deleted.
func rootGone(o createOpts) bool {
	if o.blank {
		return false
	}
	if len(o.layers) == 0 {
		_, err := os.Stat(o.lower)
		return errors.Is(err, os.ErrNotExist)
	}
	for _, l := range o.layers {
		if l.Path == "" {
			continue
		}
		if _, err := os.Stat(l.Path); errors.Is(err, os.ErrNotExist) {
			return true
		}
	}
	return false
}

// forget drops the warm roots match selects from the pool and stops their containers
// before returning, so their mounts, loop devices and open files are released.
func (w *warmPool) forget(ctx context.Context, match func(createOpts) bool) error {
	var drop []*Instance
	var wait chan struct{}
	w.mu.Lock()
	keep := w.wanted[:0:0]
	for _, key := range w.wanted {
		if o, ok := w.roots[key]; ok && match(o) {
			if key == w.preparing {
				// No longer wanted, the filler discards it once created.
				wait = w.prepared
			}
			drop = append(drop, w.ready[key]...)
			delete(w.ready, key)
			delete(w.roots, key)
			delete(w.demand, key)
			delete(w.prefetch, key)
			continue
		}
		keep = append(keep, key)
	}
	w.wanted = keep
	w.mu.Unlock()
	var errs []error
	for _, inst := range drop {
		errs = append(errs, inst.Stop(ctx))
	}
	if wait != nil {
		select {
		case <-wait:
		case <-ctx.Done():
			errs = append(errs, ctx.Err())
		}
	}
	return errors.Join(errs...)
}
