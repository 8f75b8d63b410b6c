package build

import (
	"context"
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"

	"github.com/aenv-dev/aenv/internal/catalog"
	"github.com/aenv-dev/aenv/internal/image"
	"github.com/aenv-dev/aenv/internal/image/convert"
	"github.com/aenv-dev/aenv/internal/image/install"
)

// importImage makes the pulled img the template id ("img-<digest>"), or finds it made
// by an earlier build. Where the node runs layered roots the image is also converted
// into sealed layers (shared with every image that has the same base layers), so the
// build sandbox runs on a layered root and is captured as layers.
func (s *Service) importImage(ctx context.Context, img *image.Image, id, ref string, logf func(level, msg string)) (catalog.Template, error) {
	s.pullMu.Lock()
	defer s.pullMu.Unlock()
	layered := s.convertImages()
	progress := func(p image.Progress) {
		if p.Final {
			logf("info", fmt.Sprintf("%s layer %d/%d %s (%d bytes)", p.Phase, p.Layer, p.Layers, p.Digest, p.Done))
		}
	}
	store := &image.Store{Dir: filepath.Join(s.cfg.DataDir, install.ImagesDir)}
	dir := filepath.Join(s.cfg.DataDir, install.TemplatesDir, id)
	if t, err := s.tpls.Get(id); err == nil {
		if _, err := os.Stat(t.RootFSDir); err == nil {
			if !layered || t.Layered() && preparedStack(t) {
				logf("info", fmt.Sprintf("base: image %s already imported as %s", img.Digest, id))
				return t, nil
			}
			// Imported before this node ran layered roots, or converted without the
			// sandbox-root layer: add the layers, keep the directory (sandboxes and
			// directory builds may still run on it).
			built, err := image.LoadBuilt(dir)
			if err != nil {
				return catalog.Template{}, fmt.Errorf("import %s: %w", ref, err)
			}
			return s.registerImport(ctx, img, built, id, ref, store, progress, logf)
		}
	}
	// A directory without a catalog entry is a crashed import.
	if err := os.RemoveAll(dir); err != nil {
		return catalog.Template{}, err
	}
	built, err := image.BuildTemplate(ctx, img, dir, image.BuildOptions{Store: store, Progress: progress})
	if err != nil {
		return catalog.Template{}, fmt.Errorf("import %s: %w", ref, err)
	}
	t, err := s.registerImport(ctx, img, built, id, ref, store, progress, logf)
	if err != nil {
		os.RemoveAll(dir)
	}
	return t, err
}

// registerImport converts the image when the node runs layered roots and records the
// import in the catalog.
func (s *Service) registerImport(ctx context.Context, img *image.Image, built *image.Built, id, ref string,
	store *image.Store, progress image.ProgressFunc, logf func(level, msg string)) (catalog.Template, error) {
	var obd *catalog.LayerStack
	if s.convertImages() {
		size := s.cfg.ImageDiskMB
		if size <= 0 {
			size = install.DefaultDiskMB
		}
		res, err := convert.Convert(ctx, img, convert.Options{Store: store, Dir: filepath.Join(s.cfg.DataDir, install.OverlaybdDir),
			SizeMB: size, Progress: progress, Log: s.log, User: image.DefaultUser})
		if err != nil {
			return catalog.Template{}, fmt.Errorf("convert %s into layers: %w", ref, err)
		}
		obd = res.Stack()
		logf("info", fmt.Sprintf("base: %d layers (%d converted now, the rest shared)", len(res.Layers), res.Converted))
	}
	t, err := image.Register(s.tpls, built, image.RegisterOptions{ID: id, Overlaybd: obd})
	if err != nil {
		return catalog.Template{}, fmt.Errorf("register %s: %w", ref, err)
	}
	logf("info", fmt.Sprintf("base: image %s imported as %s (layered: %v)", img.Digest, id, obd != nil))
	return t, nil
}

// convertImages reports whether image imports are converted (Config.ConvertImages).
func (s *Service) convertImages() bool {
	if s.cfg.ConvertImages != nil {
		return s.cfg.ConvertImages()
	}
	t, err := s.tpls.Get("base")
	return err == nil && t.Layered()
}

// preparedStack reports whether an import's converted stack ends with the layer that
// makes it a sandbox root (convert.Options.User): the empty ext4, one layer per image
// layer, then that one. Imports converted before it existed lack it.
func preparedStack(t catalog.Template) bool {
	var a image.Artifact
	if json.Unmarshal(t.Artifact, &a) != nil || a.Overlaybd == nil {
		return false
	}
	return len(a.Overlaybd.Layers) == len(a.Layers)+2
}
