package build

import (
	"context"
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"time"

	"github.com/aenv-dev/aenv/internal/catalog"
	"github.com/aenv-dev/aenv/internal/image/install"
)

// warmForgetter is the orchestrator's hook that stops the warm containers of a removed
// or replaced template (*orchestrator.Orchestrator).
type warmForgetter interface {
	ForgetWarm(ctx context.Context, t catalog.Template)
}

// Retired is called with a template that was deleted or replaced by a new version: the
// backend's warm containers of it stop now (they hold its layers open), then the data
// directory's garbage is collected in the background (it waits for image imports in
// progress).
func (s *Service) Retired(ctx context.Context, t catalog.Template) {
	if f, ok := s.sbx.(warmForgetter); ok {
		f.ForgetWarm(ctx, t)
	}
	s.gcAsync()
}

// gcAsync runs CollectGarbage in the background; Close waits for it.
func (s *Service) gcAsync() { s.gcAfter(0) }

// gcAfter runs CollectGarbage in the background once delay has passed; Close waits for
// it, or ends the wait (nothing is collected then: the next start does it).
func (s *Service) gcAfter(delay time.Duration) {
	s.wg.Add(1)
	go func() {
		defer s.wg.Done()
		if delay > 0 {
			t := time.NewTimer(delay)
			defer t.Stop()
			select {
			case <-s.ctx.Done():
				return
			case <-t.C:
			}
		}
		s.CollectGarbage(s.ctx)
	}()
}

// CollectGarbage removes the converted image layers, layer blobs and image imports
// (img-*) of the data directory that no catalog entry, sandbox (paused included),
// capture or running build uses (install.GC). Failures are logged: what is left is
// collected at the next run. It runs at startup and after each delete or replace.
func (s *Service) CollectGarbage(ctx context.Context) {
	s.gcMu.Lock()
	defer s.gcMu.Unlock()
	// Not while an import is between conversion and registration.
	s.pullMu.Lock()
	defer s.pullMu.Unlock()
	log := s.log.With("op", "gc")
	all, err := s.tpls.List("")
	if err != nil {
		log.Warn("list the catalog; nothing collected", "err", err)
		return
	}
	sbs, err := s.listSandboxes(ctx)
	if err != nil {
		log.Warn("list sandboxes; nothing collected", "err", err)
		return
	}
	var docs []json.RawMessage
	lowers := map[string]bool{}
	for _, sb := range sbs {
		raw, err := json.Marshal(sb)
		if err != nil {
			log.Warn("encode a sandbox record; nothing collected", "sandbox", sb.ID, "err", err)
			return
		}
		docs = append(docs, raw)
		lowers[sb.Launch.RootFS.LowerDir] = true
	}
	running := len(s.store.list(func(r *Record) bool { return r.Status == StatusBuilding })) > 0
	oci := filepath.Join(s.cfg.DataDir, "oci")
	res, err := install.GC(ctx, install.GCOptions{
		DataDir:   s.cfg.DataDir,
		Templates: all,
		Docs:      docs,
		// The OCI backend's capture records (snapshots, paused sandboxes), the states of
		// its containers (layered roots list their lowers) and the publisher's journals
		// of uploads in flight.
		DocGlobs: []string{filepath.Join(oci, "captures", "*.json"), filepath.Join(oci, "sandboxes", "*", "*.json"),
			filepath.Join(s.cfg.DataDir, "snapshot", "publishing", "*.json")},
		InUse:       func(dir string) bool { return lowers[dir] },
		KeepImports: running,
		Grace:       s.cfg.GCGrace,
		DeleteImport: func(t catalog.Template) error {
			if _, err := s.tpls.Delete(t.ID); err != nil {
				return err
			}
			s.unpublish(ctx, t.ID)
			if f, ok := s.sbx.(warmForgetter); ok {
				f.ForgetWarm(ctx, t)
			}
			return nil
		},
	})
	if err != nil {
		log.Warn("collect the data directory's garbage", "err", err)
	}
	if n := len(res.Imports) + len(res.Layers) + len(res.Blobs) + len(res.Dirs); n > 0 {
		log.Info("collected unused image data", "imports", res.Imports, "layers", len(res.Layers),
			"blobs", len(res.Blobs), "dirs", len(res.Dirs), "bytes", res.Bytes)
	}
}

// deleteUnbuilt removes a template that exists only as build records (every build
// failed, or none has run yet), found by id or name: GET and the list show it, so it
// can be deleted. Unknown is ErrNotFound.
func (s *Service) deleteUnbuilt(ctx context.Context, idOrAlias string) (catalog.Template, error) {
	recs := s.store.list(func(r *Record) bool { return r.TemplateID == idOrAlias || r.Name == idOrAlias })
	if len(recs) == 0 {
		return catalog.Template{}, fmt.Errorf("template %q: %w", idOrAlias, ErrNotFound)
	}
	last := recs[len(recs)-1]
	t := catalog.Template{ID: last.TemplateID, Aliases: []string{last.Name}}
	for _, r := range s.Builds(t.ID) {
		if r.Status == StatusBuilding {
			return catalog.Template{}, fmt.Errorf("%w: template %s has a build running (%s)", ErrConflict, t.ID, r.ID)
		}
	}
	if err := s.tags.forget(t.ID); err != nil {
		s.log.Warn("remove template tags", "template", t.ID, "err", err)
	}
	if err := s.Forget(t.ID); err != nil {
		return catalog.Template{}, err
	}
	// What failed builds left on disk (no sandbox runs on a failed build).
	if s.pruneBuilds(ctx, t.ID, "") == 0 {
		os.RemoveAll(filepath.Join(s.cfg.DataDir, install.TemplatesDir, t.ID))
	}
	return t, nil
}
