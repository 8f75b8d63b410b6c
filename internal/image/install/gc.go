package install

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"time"

	"github.com/aenv-dev/aenv/internal/catalog"
	"github.com/aenv-dev/aenv/internal/dirlock"
)

// ImportPrefix starts the ids of the templates builds import images as (img-<digest>).
const ImportPrefix = "img-"

// DefaultGCGrace is GCOptions.Grace's default.
const DefaultGCGrace = 10 * time.Minute

// GCOptions describe what GC may remove and what it must keep.
type GCOptions struct {
	DataDir string
	// Templates is the whole catalog, every kind: templates, snapshots and paused
	// sandboxes' captures. A converted layer, blob or import any of them names (by path,
	// file name, cache key or digest, anywhere in the entry) is kept.
	Templates []catalog.Template
	// Docs are further JSON documents whose strings name what must be kept (sandbox
	// records; the backend's capture records and sandbox states, from DocGlobs).
	Docs []json.RawMessage
	// DocGlobs are glob patterns of JSON files read as Docs (a file that cannot be read
	// or parsed fails the GC: what it names is unknown).
	DocGlobs []string
	// InUse reports whether a sandbox runs on a directory template's rootfs (nil: none).
	InUse func(rootfsDir string) bool
	// KeepImports keeps every image import: a build is running, and the import it just
	// made is not named by any template yet.
	KeepImports bool
	// DeleteImport removes an unreferenced image import from the catalog (nil: imports
	// are kept). Its directory is removed by GC afterwards.
	DeleteImport func(t catalog.Template) error
	// Grace spares files changed more recently than this (default DefaultGCGrace): a
	// pull or import in progress has converted or fetched them but not registered the
	// template that names them yet (Convert and Store.Fetch touch what they reuse).
	Grace time.Duration
}

// GCResult lists what GC removed.
type GCResult struct {
	Imports []string // template ids
	Layers  []string // converted layer files
	Blobs   []string // layer blob files
	Dirs    []string // import directories
	Bytes   int64
}

// GC removes from the data directory what no catalog entry, sandbox or capture uses any
// more: image imports (img-* templates) no other template is built on, converted layers
// (<data>/images/overlaybd, shared between images by diff-id chain), cached layer blobs
// (<data>/images/layers) and leftover import directories. It is meant to run when a
// template is deleted or replaced and at startup. Lineage is honoured because every
// entry names all of its stack: a snapshot or a built template lists its base image's
// converted layers as lowers (by path, or by digest once published), so they stay.
func GC(ctx context.Context, o GCOptions) (GCResult, error) {
	if o.DataDir == "" {
		return GCResult{}, errors.New("install: gc: DataDir is required")
	}
	if o.Grace <= 0 {
		o.Grace = DefaultGCGrace
	}
	docs := append([]json.RawMessage(nil), o.Docs...)
	for _, g := range o.DocGlobs {
		files, err := filepath.Glob(g)
		if err != nil {
			return GCResult{}, fmt.Errorf("install: gc: %w", err)
		}
		for _, f := range files {
			b, err := os.ReadFile(f)
			if errors.Is(err, fs.ErrNotExist) {
				continue // removed meanwhile (a sandbox that ended)
			}
			if err != nil {
				return GCResult{}, fmt.Errorf("install: gc: %w", err)
			}
			docs = append(docs, b)
		}
	}
	var docRefs refs
	for _, d := range docs {
		if err := docRefs.addJSON(d); err != nil {
			return GCResult{}, fmt.Errorf("install: gc: %w", err)
		}
	}
	byTemplate := make([]refs, len(o.Templates))
	for n, t := range o.Templates {
		raw, err := json.Marshal(t)
		if err != nil {
			return GCResult{}, fmt.Errorf("install: gc: %w", err)
		}
		if err := byTemplate[n].addJSON(raw); err != nil {
			return GCResult{}, fmt.Errorf("install: gc: %w", err)
		}
	}
	var res GCResult
	tdir := filepath.Join(o.DataDir, TemplatesDir)
	gone := map[int]bool{}
	if !o.KeepImports && o.DeleteImport != nil {
		for n, t := range o.Templates {
			if !isImport(t) {
				continue
			}
			dir := filepath.Join(tdir, t.ID)
			used := docRefs.names(t.ID, dir) || o.InUse != nil && t.RootFSDir != "" && o.InUse(t.RootFSDir)
			for m := range o.Templates {
				used = used || m != n && byTemplate[m].names(t.ID, dir)
			}
			if used {
				continue
			}
			if err := o.DeleteImport(t); err != nil {
				return res, fmt.Errorf("install: gc: remove import %s: %w", t.ID, err)
			}
			gone[n] = true
			res.Imports = append(res.Imports, t.ID)
		}
	}
	all := docRefs
	imports := map[string]bool{}
	for n, t := range o.Templates {
		if gone[n] {
			continue
		}
		all.merge(byTemplate[n])
		imports[t.ID] = true
	}
	var errs []error
	errs = append(errs, o.sweepImportDirs(tdir, imports, &res))
	errs = append(errs, o.sweepLayers(ctx, &all, &res))
	errs = append(errs, o.sweepBlobs(&all, &res))
	return res, errors.Join(errs...)
}

func isImport(t catalog.Template) bool {
	return t.Kind == catalog.KindTemplate && strings.HasPrefix(t.ID, ImportPrefix)
}

// old reports whether fi changed before the grace period.
func (o *GCOptions) old(fi fs.FileInfo) bool { return time.Since(fi.ModTime()) > o.Grace }

// sweepImportDirs removes <data>/templates/img-* directories of imports not in the
// catalog (removed now, or left by a crash) that no sandbox runs on.
func (o *GCOptions) sweepImportDirs(tdir string, catalogued map[string]bool, res *GCResult) error {
	ents, err := os.ReadDir(tdir)
	if errors.Is(err, fs.ErrNotExist) {
		return nil
	}
	if err != nil {
		return fmt.Errorf("install: gc: %w", err)
	}
	var errs []error
	for _, e := range ents {
		if !e.IsDir() || !strings.HasPrefix(e.Name(), ImportPrefix) || catalogued[e.Name()] {
			continue
		}
		dir := filepath.Join(tdir, e.Name())
		fi, err := e.Info()
		if err != nil || !o.old(fi) && !slices.Contains(res.Imports, e.Name()) {
			continue // an import being registered right now
		}
		if o.InUse != nil && o.InUse(filepath.Join(dir, "rootfs")) {
			continue
		}
		if err := os.RemoveAll(dir); err != nil {
			errs = append(errs, fmt.Errorf("install: gc: %w", err))
			continue
		}
		res.Dirs = append(res.Dirs, dir)
	}
	return errors.Join(errs...)
}

// convertedExt and digestExt name convert's layer files and their digest sidecars.
const (
	convertedExt = ".zfile"
	digestExt    = ".sha256"
)

// sweepLayers removes converted layers nothing names, holding the cache directory's
// lock so that no conversion builds on one meanwhile.
func (o *GCOptions) sweepLayers(ctx context.Context, r *refs, res *GCResult) error {
	dir := filepath.Join(o.DataDir, OverlaybdDir)
	if _, err := os.Stat(dir); errors.Is(err, fs.ErrNotExist) {
		return nil
	}
	unlock, err := dirlock.Acquire(ctx, dir)
	if err != nil {
		return fmt.Errorf("install: gc: %w", err)
	}
	defer unlock()
	ents, err := os.ReadDir(dir)
	if err != nil {
		return fmt.Errorf("install: gc: %w", err)
	}
	var errs []error
	for _, e := range ents {
		name := e.Name()
		fi, err := e.Info()
		if err != nil || !fi.Mode().IsRegular() || !o.old(fi) {
			continue
		}
		if strings.HasPrefix(name, ".") {
			// A conversion's scratch file a crash left (.<key>.tmp, .base-ext4.raw); the
			// lock is ours, so no conversion is writing it.
			if strings.HasSuffix(name, ".tmp") || name == ".base-ext4.raw" {
				errs = append(errs, o.remove(filepath.Join(dir, name), fi, nil, res))
			}
			continue
		}
		key, ok := strings.CutSuffix(name, convertedExt)
		if !ok {
			continue
		}
		path := filepath.Join(dir, name)
		if r.has(path) || r.has(name) || r.has(key) {
			continue
		}
		digest, err := layerDigest(path)
		if err != nil {
			errs = append(errs, err)
			continue
		}
		if r.has(digest) {
			continue
		}
		errs = append(errs, o.remove(path, fi, &res.Layers, res))
		if err := os.Remove(filepath.Join(dir, key+digestExt)); err != nil && !errors.Is(err, fs.ErrNotExist) {
			errs = append(errs, err)
		}
	}
	return errors.Join(errs...)
}

// layerDigest is a converted layer's content digest: its sidecar, else computed (a
// layer converted before sidecars, or whose sidecar write failed).
func layerDigest(path string) (string, error) {
	if b, err := os.ReadFile(strings.TrimSuffix(path, convertedExt) + digestExt); err == nil && strings.HasPrefix(string(b), "sha256:") {
		return strings.TrimSpace(string(b)), nil
	}
	f, err := os.Open(path)
	if err != nil {
		return "", fmt.Errorf("install: gc: %w", err)
	}
	defer f.Close()
	h := sha256.New()
	if _, err := io.Copy(h, f); err != nil {
		return "", fmt.Errorf("install: gc: %w", err)
	}
	return "sha256:" + hex.EncodeToString(h.Sum(nil)), nil
}

// sweepBlobs removes cached layer blobs (<data>/images/layers/sha256/<hex>) nothing
// names: imports and pulled templates list their image's layers by digest.
func (o *GCOptions) sweepBlobs(r *refs, res *GCResult) error {
	dir := filepath.Join(o.DataDir, ImagesDir, "layers", "sha256")
	ents, err := os.ReadDir(dir)
	if errors.Is(err, fs.ErrNotExist) {
		return nil
	}
	if err != nil {
		return fmt.Errorf("install: gc: %w", err)
	}
	var errs []error
	for _, e := range ents {
		fi, err := e.Info()
		if err != nil || !fi.Mode().IsRegular() || !o.old(fi) {
			continue
		}
		if strings.HasPrefix(e.Name(), ".tmp-") {
			// A download a crash interrupted (the store writes .tmp-* then renames).
			errs = append(errs, o.remove(filepath.Join(dir, e.Name()), fi, nil, res))
			continue
		}
		if r.has("sha256:" + e.Name()) {
			continue
		}
		errs = append(errs, o.remove(filepath.Join(dir, e.Name()), fi, &res.Blobs, res))
	}
	return errors.Join(errs...)
}

func (o *GCOptions) remove(path string, fi fs.FileInfo, list *[]string, res *GCResult) error {
	if err := os.Remove(path); err != nil && !errors.Is(err, fs.ErrNotExist) {
		return fmt.Errorf("install: gc: %w", err)
	}
	if list != nil {
		*list = append(*list, path)
	}
	res.Bytes += fi.Size()
	return nil
}

// refs is the set of strings found in JSON documents, with the base names of paths, so
// a layer is found however an artifact names it. The strings are kept too, to find
// paths under an import's directory.
type refs struct {
	set  map[string]bool
	strs []string
}

func (r *refs) add(s string) {
	if r.set == nil {
		r.set = map[string]bool{}
	}
	if s == "" || r.set[s] {
		return
	}
	r.set[s] = true
	r.strs = append(r.strs, s)
	if strings.Contains(s, "/") {
		r.set[filepath.Base(s)] = true
		r.set[filepath.Clean(s)] = true
	}
}

func (r *refs) has(s string) bool { return r.set[s] }

func (r *refs) merge(o refs) {
	for _, s := range o.strs {
		r.add(s)
	}
}

// names reports whether the documents name template id or a path in its directory.
func (r *refs) names(id, dir string) bool {
	if r.has(id) {
		return true
	}
	for _, s := range r.strs {
		if s == dir || strings.HasPrefix(s, dir+"/") {
			return true
		}
	}
	return false
}

// addJSON adds every string in doc, including those of JSON documents held in strings
// (artifacts embedded in records).
func (r *refs) addJSON(doc []byte) error {
	var v any
	if err := json.Unmarshal(doc, &v); err != nil {
		return err
	}
	r.walk(v)
	return nil
}

func (r *refs) walk(v any) {
	switch x := v.(type) {
	case string:
		r.add(x)
		if t := strings.TrimSpace(x); strings.HasPrefix(t, "{") || strings.HasPrefix(t, "[") {
			var inner any
			if json.Unmarshal([]byte(t), &inner) == nil {
				r.walk(inner)
			}
		}
	case map[string]any:
		for k, e := range x {
			r.add(k)
			r.walk(e)
		}
	case []any:
		for _, e := range x {
			r.walk(e)
		}
	}
}
