package build

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"maps"
	"os"
	"slices"

	"github.com/aenv-dev/aenv/internal/catalog"
	"github.com/aenv-dev/aenv/internal/image"
	"github.com/aenv-dev/aenv/internal/orchestrator"
	"github.com/aenv-dev/aenv/internal/sandbox"
)

// Layered templates.
//
// A build sandbox on a layered (block) root is captured the way a sandbox snapshot is:
// its writable upper is sealed in place into a new layer on top of the base template's
// sealed layers (SealAndRestack), with no tar and no copy. The template is that stack;
// sandboxes created from it share every layer and get an upper of their own, so they
// can snapshot, fork and pause to disk like any sandbox on a layered template.
//
// The sealed layer belongs to the backend's capture, which the template's artifact
// keeps ("capture"). The capture is discarded when the template is deleted or rebuilt;
// the backend then frees only layers that no live sandbox, snapshot or paused sandbox
// still uses (a snapshot of a sandbox of the template names the template's layers as
// its lowers, so it keeps them).

// SandboxCapturer is what a snapshot capture needs from the orchestrator
// (*orchestrator.Orchestrator): seal a running sandbox's root into layers without
// registering a snapshot, and give such a capture back.
type SandboxCapturer interface {
	CaptureSandbox(ctx context.Context, id string) (json.RawMessage, error)
	DiscardCapture(ctx context.Context, raw json.RawMessage) error
}

// LayersArtifactKind marks the artifact of a template captured from a layered build.
const LayersArtifactKind = "build-layers"

// LayersArtifact is a layered build template's catalog artifact. Its "overlaybd" member
// is the stack every layered template carries (catalog.LayerStack: what sandboxes are
// launched on, and what the repository publisher rewrites for another node).
type LayersArtifact struct {
	Kind string `json:"kind"`
	// Base is the template the build started from, Build the build that made this.
	Base  string `json:"base,omitempty"`
	Build string `json:"build,omitempty"`
	// Overlaybd is the stack: the base's sealed layers, then the build's, bottom first.
	Overlaybd catalog.LayerStack `json:"overlaybd"`
	// VirtualSize is the disk size in bytes; Resources those of the build sandbox.
	VirtualSize uint64            `json:"virtualSize"`
	Resources   sandbox.Resources `json:"resources"`
	// Image is the image configuration the template carries (the catalog's copy of it
	// is this node's; the artifact travels to other nodes).
	Image ImageConfig `json:"image"`
	// Capture is the backend's capture the layers came from, discarded with the template.
	Capture json.RawMessage `json:"capture"`
}

// ImageConfig is the part of an image's configuration a template keeps.
type ImageConfig struct {
	User         string            `json:"user,omitempty"`
	ExposedPorts []string          `json:"exposedPorts,omitempty"`
	Labels       map[string]string `json:"labels,omitempty"`
	Entrypoint   []string          `json:"entrypoint,omitempty"`
	Cmd          []string          `json:"cmd,omitempty"`
}

// captureOf is the part of a backend capture (oci.Captured) the artifact is made of.
type captureOf struct {
	Layers      []sandbox.LayerRef `json:"layers"`
	VirtualSize uint64             `json:"virtualSize"`
	Resources   sandbox.Resources  `json:"resources"`
	// Upper are an overlay root's upper layers, a filesystem of their own: such a
	// capture is not one stack, so it cannot be a template's.
	Upper []json.RawMessage `json:"upper"`
}

// snapshotCapture is the Capturer for build sandboxes on layered roots. A sandbox the
// backend cannot capture (a directory root) is captured by fallback instead.
type snapshotCapture struct {
	sbx      SandboxCapturer
	fallback Capturer
}

// Capture implements Capturer: dir is not used, the layers stay where the backend
// sealed them.
func (c snapshotCapture) Capture(ctx context.Context, s *Session, dir string, logf func(level, msg string)) (Captured, error) {
	raw, err := c.sbx.CaptureSandbox(ctx, s.SandboxID)
	if errors.Is(err, orchestrator.ErrUnsupported) {
		logf("info", "capture: the build sandbox runs on a directory root; copying it out with tar")
		return c.fallback.Capture(ctx, s, dir, logf)
	}
	if err != nil {
		return Captured{}, fmt.Errorf("capture: snapshot the build sandbox: %w", err)
	}
	var co captureOf
	if err := json.Unmarshal(raw, &co); err == nil && len(co.Upper) > 0 {
		// A build on a snapshot taken on an overlay root (a fresh build sandbox gets a
		// root of its own, see CreateRequest.FlatRoot).
		if derr := c.sbx.DiscardCapture(context.WithoutCancel(ctx), raw); derr != nil {
			logf("warn", "capture: discard the overlay root's capture: "+derr.Error())
		}
		logf("info", "capture: the build sandbox runs on an overlay root, whose capture is two stacks; copying it out with tar")
		return c.fallback.Capture(ctx, s, dir, logf)
	}
	if err := json.Unmarshal(raw, &co); err != nil || len(co.Layers) == 0 || co.VirtualSize == 0 {
		if derr := c.sbx.DiscardCapture(context.WithoutCancel(ctx), raw); derr != nil {
			logf("warn", "capture: discard an unusable capture: "+derr.Error())
		}
		if err == nil {
			err = errors.New("it names no layers or no disk size")
		}
		return Captured{}, fmt.Errorf("capture: unusable capture from the backend: %w", err)
	}
	a := &LayersArtifact{Kind: LayersArtifactKind, VirtualSize: co.VirtualSize, Resources: co.Resources, Capture: raw,
		Overlaybd: catalog.LayerStack{SizeMB: int((co.VirtualSize + 1<<20 - 1) >> 20), Layers: co.Layers}}
	logf("info", fmt.Sprintf("captured %d sealed layers (%d MiB disk)", len(co.Layers), a.Overlaybd.SizeMB))
	return Captured{Layers: a}, nil
}

// capturer picks how a build sandbox becomes the template: the configured Capturer,
// else a snapshot where the orchestrator can capture it (a layered root: a layered
// template's or a snapshot's), else TarCapture.
func (s *Service) capturer() Capturer {
	if s.cfg.Capturer != nil {
		return s.cfg.Capturer
	}
	if c, ok := s.sbx.(SandboxCapturer); ok {
		return snapshotCapture{sbx: c, fallback: TarCapture{}}
	}
	return TarCapture{}
}

// layersArtifact decodes a template's artifact when it is a layered build's.
func layersArtifact(t catalog.Template) (*LayersArtifact, bool) {
	var a LayersArtifact
	if len(t.Artifact) == 0 || json.Unmarshal(t.Artifact, &a) != nil || a.Kind != LayersArtifactKind {
		return nil, false
	}
	return &a, true
}

// discardCapture gives the capture of a layered build template back to the backend,
// which frees the layers nothing else uses. Templates of other kinds hold no capture.
func (s *Service) discardCapture(ctx context.Context, t catalog.Template) {
	a, ok := layersArtifact(t)
	if !ok || len(a.Capture) == 0 {
		return
	}
	c, ok := s.sbx.(SandboxCapturer)
	if !ok {
		return
	}
	if err := c.DiscardCapture(context.WithoutCancel(ctx), a.Capture); err != nil {
		s.log.Warn("discard the template's capture; its layers stay until the backend reconciles",
			"template", t.ID, "err", err)
	}
}

// dropCapture removes what a capture made for a template that was not registered:
// nothing else refers to it yet.
func (s *Service) dropCapture(ctx context.Context, c Captured, dir string) {
	if c.Layers == nil {
		os.RemoveAll(dir)
		return
	}
	if sc, ok := s.sbx.(SandboxCapturer); ok {
		if err := sc.DiscardCapture(context.WithoutCancel(ctx), c.Layers.Capture); err != nil {
			s.log.Warn("discard the capture of a failed build", "err", err)
		}
	}
}

// journalCapture records a layered capture in the build's record before the template
// that will own it is registered (see reclaimCapture).
func (s *Service) journalCapture(buildID string, c Captured) error {
	if c.Layers == nil {
		return nil
	}
	_, err := s.store.update(buildID, func(r *Record) error { r.Capture = c.Layers.Capture; return nil })
	return err
}

// reclaimCapture gives back the capture of a build the node stopped during, unless its
// template was registered with it before the node stopped.
func (s *Service) reclaimCapture(r Record) {
	sc, ok := s.sbx.(SandboxCapturer)
	if len(r.Capture) == 0 || !ok {
		return
	}
	if t, err := s.tpls.Get(r.TemplateID); err == nil {
		if a, ok := layersArtifact(t); ok && captureID(a.Capture) == captureID(r.Capture) {
			return
		}
	}
	if err := sc.DiscardCapture(context.Background(), r.Capture); err != nil {
		s.log.Warn("give back the capture of an interrupted build", "build", r.ID, "err", err)
	}
}

// captureID is the id a backend capture names itself by ("" when it has none).
func captureID(raw json.RawMessage) string {
	var c struct {
		ID string `json:"id"`
	}
	if json.Unmarshal(raw, &c) != nil {
		return ""
	}
	return c.ID
}

// imageConfig is the image configuration a build inherits from its base: the catalog's
// fields, else the base's artifact (an imported image's config, a layered build's).
func imageConfig(t catalog.Template) ImageConfig {
	c := ImageConfig{ExposedPorts: slices.Clone(t.ExposedPorts), Labels: maps.Clone(t.Labels),
		Entrypoint: slices.Clone(t.Entrypoint), Cmd: slices.Clone(t.Cmd)}
	var fromArt ImageConfig
	if a, ok := layersArtifact(t); ok {
		// A build's final user is its DefaultUser already; the image's is history.
		fromArt = a.Image
		fromArt.User = ""
	} else {
		var ia image.Artifact
		if len(t.Artifact) > 0 && json.Unmarshal(t.Artifact, &ia) == nil && ia.Kind == image.ArtifactKind {
			fromArt = ImageConfig{User: ia.Config.User, ExposedPorts: ia.Config.ExposedPorts, Labels: ia.Config.Labels,
				Entrypoint: ia.Config.Entrypoint, Cmd: ia.Config.Cmd}
		}
	}
	c.User = fromArt.User
	if c.ExposedPorts == nil {
		c.ExposedPorts = slices.Clone(fromArt.ExposedPorts)
	}
	if c.Labels == nil {
		c.Labels = maps.Clone(fromArt.Labels)
	}
	if c.Entrypoint == nil && c.Cmd == nil {
		c.Entrypoint, c.Cmd = slices.Clone(fromArt.Entrypoint), slices.Clone(fromArt.Cmd)
	}
	return c
}

// templateStorage fills in how t stores its root filesystem from a capture.
func templateStorage(t *catalog.Template, c Captured, rec Record, base string, cfg ImageConfig) error {
	if c.Layers == nil {
		t.RootFSDir, t.Artifact = c.RootFSDir, c.Artifact
		return nil
	}
	a := *c.Layers
	a.Base, a.Build, a.Image = base, rec.ID, cfg
	raw, err := json.Marshal(a)
	if err != nil {
		return fmt.Errorf("encode the template's artifact: %w", err)
	}
	t.RootFSDir, t.Artifact = "", raw
	return nil
}
