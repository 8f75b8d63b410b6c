package rootfs

import (
	"encoding/json"
	"fmt"

	"github.com/aenv-dev/aenv/internal/sandbox"
)

// templateArtifact is the part of an image template's catalog artifact
// (image.Artifact) that describes its converted layer stack (convert.Result).
type templateArtifact struct {
	Overlaybd *struct {
		SizeMB int                `json:"sizeMB"`
		Layers []sandbox.LayerRef `json:"layers"`
	} `json:"overlaybd"`
}

// TemplateRootFS is the RootFS of sandboxes created from a template whose unpacked
// directory is dir and whose catalog artifact is artifact: the converted overlaybd stack
// when the template has one (aenv pull --convert), the directory otherwise. An artifact
// that is not an image template's (or none) yields the directory alone.
func TemplateRootFS(dir string, artifact json.RawMessage) (sandbox.RootFS, error) {
	fs := sandbox.RootFS{LowerDir: dir}
	if len(artifact) == 0 {
		return fs, nil
	}
	var a templateArtifact
	if err := json.Unmarshal(artifact, &a); err != nil {
		return fs, fmt.Errorf("rootfs: template artifact: %w", err)
	}
	if a.Overlaybd == nil || len(a.Overlaybd.Layers) == 0 {
		return fs, nil
	}
	fs.Layers = a.Overlaybd.Layers
	if a.Overlaybd.SizeMB > 0 {
		fs.VirtualSize = uint64(a.Overlaybd.SizeMB) << 20
	}
	return fs, nil
}
