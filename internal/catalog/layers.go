package catalog

import (
	"encoding/json"
	"fmt"

	"github.com/aenv-dev/aenv/internal/sandbox"
)

// LayerStack is what makes a template layered: sealed overlaybd layers, bottom first,
// holding an ext4 filesystem of SizeMB MiB. Every layered template's artifact (a
// converted image, the layered base, a layered build) carries it under "overlaybd",
// and it is all a backend needs to boot one; the rest of an artifact belongs to the
// package that made it. The repository publisher rewrites the layer refs' paths and
// digests in place for another node.
type LayerStack struct {
	SizeMB int                `json:"sizeMB"`
	Layers []sandbox.LayerRef `json:"layers"`
}

// layeredArtifact is the part of a template artifact every layered template shares.
type layeredArtifact struct {
	Overlaybd *LayerStack `json:"overlaybd"`
}

// DecodeLayers returns the layer stack of a template artifact, or nil when it has none
// (no artifact, a directory template's, an empty stack). A malformed artifact is an
// error.
func DecodeLayers(artifact json.RawMessage) (*LayerStack, error) {
	if len(artifact) == 0 {
		return nil, nil
	}
	var a layeredArtifact
	if err := json.Unmarshal(artifact, &a); err != nil {
		return nil, fmt.Errorf("catalog: template artifact: %w", err)
	}
	if a.Overlaybd == nil || len(a.Overlaybd.Layers) == 0 {
		return nil, nil
	}
	return a.Overlaybd, nil
}

// Layers is DecodeLayers of t's artifact (nil for a snapshot: its artifact is the
// backend's capture, which has no "overlaybd" member).
func (t Template) Layers() (*LayerStack, error) { return DecodeLayers(t.Artifact) }

// Layered reports whether sandboxes of t run on a layered root (its artifact names
// layers and decodes).
func (t Template) Layered() bool {
	ls, err := t.Layers()
	return err == nil && ls != nil
}

// RootFS is the layered root of sandboxes launched on the stack.
func (s *LayerStack) RootFS() sandbox.RootFS {
	fs := sandbox.RootFS{Layers: s.Layers}
	if s.SizeMB > 0 {
		fs.VirtualSize = uint64(s.SizeMB) << 20
	}
	return fs
}
