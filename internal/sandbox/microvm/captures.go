package microvm

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"

	"github.com/aenv-dev/aenv/internal/sandbox"
)

var _ sandbox.CaptureReconciler = (*Backend)(nil)

// ReconcileCaptures implements sandbox.CaptureReconciler: it removes the captures a crash
// left unregistered — persistent ones (DataDir/captures/<id>: sealed disk layer, RAM file,
// device state) and transient fork images (RAMDir/images/<id>) — so a node killed in a
// snapshot, a fork or a pause leaves nothing partial behind. A capture is kept when an artifact the
// orchestrator holds names a path inside it (whatever the artifact's shape: a catalog
// snapshot, a paused sandbox's state, another backend's record never names ours), or
// when a running VM's disk has one of its layers as a lower (a seal the crash
// interrupted after it happened is part of the disk: the layers stay, its memory image
// goes). Memory blobs fetched from the repository (DataDir/memory) are not captures of
// this node and are left alone.
//
// It runs after Reconcile, before any request: no capture is in flight.
func (b *Backend) ReconcileCaptures(_ context.Context, referenced []json.RawMessage) error {
	// Referenced: captures and images by id. Lowers of running disks: capture dirs only
	// (the memory image of a capture nobody registered goes even when its layer stays).
	keep, lowers, lowerPaths := map[string]bool{}, map[string]bool{}, map[string]bool{}
	for _, raw := range referenced {
		if len(raw) == 0 {
			continue
		}
		var v any
		if err := json.NewDecoder(bytes.NewReader(raw)).Decode(&v); err != nil {
			return fmt.Errorf("microvm: reconcile captures: an artifact is not JSON, keeping every capture: %w", err)
		}
		b.captureIDs(v, keep)
	}
	b.mu.Lock()
	for _, inst := range b.instances {
		inst.mu.Lock()
		if inst.disk != nil {
			for _, l := range inst.disk.Lowers() {
				b.captureIDs(l.Path, lowers)
				lowerPaths[l.Path] = true
			}
		}
		inst.mu.Unlock()
	}
	b.mu.Unlock()
	var errs []error
	for _, dir := range []string{b.cfg.capturesDir(), b.cfg.imagesDir()} {
		ents, err := os.ReadDir(dir)
		if errors.Is(err, os.ErrNotExist) {
			continue
		}
		if err != nil {
			errs = append(errs, fmt.Errorf("microvm: reconcile captures: %w", err))
			continue
		}
		for _, e := range ents {
			if keep[e.Name()] {
				continue
			}
			if dir == b.cfg.capturesDir() && lowers[e.Name()] {
				// Sealed into a running disk, never registered: the layers stay, the
				// memory image written next to them goes.
				errs = append(errs, b.keepOnly(filepath.Join(dir, e.Name()), lowerPaths))
				continue
			}
			b.log.Info("microvm: removing a capture nothing references (left by a crash)", "path", filepath.Join(dir, e.Name()))
			if err := os.RemoveAll(filepath.Join(dir, e.Name())); err != nil {
				errs = append(errs, err)
			}
		}
	}
	// Gone once empty, as removeImage leaves it (RAMDir then holds only running VMs'
	// RAM files).
	_ = os.Remove(b.cfg.imagesDir())
	return errors.Join(errs...)
}

// keepOnly removes every file in dir that is not in keep.
func (b *Backend) keepOnly(dir string, keep map[string]bool) error {
	ents, err := os.ReadDir(dir)
	if err != nil {
		return fmt.Errorf("microvm: reconcile captures: %w", err)
	}
	var errs []error
	for _, e := range ents {
		if p := filepath.Join(dir, e.Name()); !keep[p] {
			b.log.Info("microvm: removing an unregistered capture's memory image file (its disk layer runs on)", "path", p)
			errs = append(errs, os.RemoveAll(p))
		}
	}
	return errors.Join(errs...)
}

// captureIDs adds to ids the capture of every string in v that is a path inside one
// of this backend's capture directories.
func (b *Backend) captureIDs(v any, ids map[string]bool) {
	switch x := v.(type) {
	case string:
		for _, dir := range []string{b.cfg.capturesDir(), b.cfg.imagesDir()} {
			if rest, ok := strings.CutPrefix(filepath.Clean(x), dir+string(filepath.Separator)); ok {
				id, _, _ := strings.Cut(rest, string(filepath.Separator))
				ids[id] = true
			}
		}
	case map[string]any:
		for _, c := range x {
			b.captureIDs(c, ids)
		}
	case []any:
		for _, c := range x {
			b.captureIDs(c, ids)
		}
	}
}
