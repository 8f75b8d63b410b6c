package install

import (
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"strings"
)

// retiredMark is the file that marks a template directory for removal.
const retiredMark = ".retired"

// Retire marks the template directory holding rootfsDir (<data-dir>/templates/<id>, as
// Run made it) for removal by SweepRetired: the template that used it was replaced, but
// sandboxes may still run on it. Directories elsewhere (the base template's, a build's)
// are not install's and are left alone (false).
func Retire(dataDir, rootfsDir string) (bool, error) {
	dir, ok := templateDir(dataDir, rootfsDir)
	if !ok {
		return false, nil
	}
	if err := os.WriteFile(filepath.Join(dir, retiredMark), nil, 0o644); err != nil {
		if errors.Is(err, fs.ErrNotExist) {
			return false, nil // already gone
		}
		return false, fmt.Errorf("install: retire %s: %w", dir, err)
	}
	return true, nil
}

// templateDir returns <data-dir>/templates/<id> when rootfsDir is its rootfs.
func templateDir(dataDir, rootfsDir string) (string, bool) {
	root := filepath.Join(dataDir, TemplatesDir)
	rel, err := filepath.Rel(root, filepath.Clean(rootfsDir))
	if err != nil || rel == "." || strings.HasPrefix(rel, "..") {
		return "", false
	}
	id, rest, _ := strings.Cut(filepath.ToSlash(rel), "/")
	if rest != "rootfs" || id == "base" || strings.HasPrefix(id, ".") {
		return "", false
	}
	return filepath.Join(root, id), true
}

// SweepRetired removes the retired template directories whose rootfs no sandbox runs on
// (inUse reports a rootfs directory a sandbox uses; nil: none does) and returns them.
// It is called after each replace, so a directory still in use then goes at a later one.
func SweepRetired(dataDir string, inUse func(rootfsDir string) bool) ([]string, error) {
	root := filepath.Join(dataDir, TemplatesDir)
	ents, err := os.ReadDir(root)
	if errors.Is(err, fs.ErrNotExist) {
		return nil, nil
	}
	if err != nil {
		return nil, fmt.Errorf("install: sweep: %w", err)
	}
	var removed []string
	var errs []error
	for _, e := range ents {
		dir := filepath.Join(root, e.Name())
		if !e.IsDir() {
			continue
		}
		if _, err := os.Lstat(filepath.Join(dir, retiredMark)); err != nil {
			continue
		}
		if inUse != nil && inUse(filepath.Join(dir, "rootfs")) {
			continue
		}
		if err := os.RemoveAll(dir); err != nil {
			errs = append(errs, fmt.Errorf("install: sweep %s: %w", dir, err))
			continue
		}
		removed = append(removed, dir)
	}
	return removed, errors.Join(errs...)
}
