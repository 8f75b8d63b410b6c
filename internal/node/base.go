package node

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"maps"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"time"

	"github.com/aenv-dev/aenv/internal/catalog"
	"github.com/aenv-dev/aenv/internal/config"
	"github.com/aenv-dev/aenv/internal/template/base"
	"github.com/aenv-dev/aenv/internal/template/layered"
)

// BaseTemplateID is the template the SDKs create from by default: Debian with what E2B's
// base has (python3, node, git, curl, sudo). The node installs it itself.
const BaseTemplateID = "base"

// MinimalTemplateID is the busybox base: built from the host's static binaries in a
// second at every first start, for the fastest sandboxes and for tests.
const MinimalTemplateID = "base-minimal"

// ensureBaseTemplates makes sure the built-in templates exist, so Sandbox.create() with
// the SDK's default template works on a fresh node. base-minimal is built from the host's
// busybox-static and bash-static before Open returns. base is installed from the prebuilt
// rootfs given by templates.base_rootfs (copied into the data dir, so the node does not
// depend on a build tree), else built with debootstrap: that takes minutes, so it runs in
// the background (bs reports it; creates from base answer 503 meanwhile, saying so).
// Each is then made layered (one sealed ext4 layer), so their sandboxes run on block roots
// that can be snapshotted, forked and paused to disk; where that cannot be made (no
// mkfs.ext4) they stay directory templates and those operations answer 501.
func ensureBaseTemplates(ctx context.Context, cat *catalog.Catalog, cfg config.Config, log *slog.Logger, bs *baseBuild) error {
	dir, ok, err := installedBuiltin(cat, cfg, MinimalTemplateID, base.Built, log)
	if err != nil {
		return err
	}
	if !ok {
		log.Info("building the base-minimal template", "dir", dir)
		if err := base.Build(ctx, base.Options{Out: dir}); err != nil {
			return fmt.Errorf("build the base-minimal template: %w", err)
		}
	}
	if err := registerBuiltin(ctx, cat, cfg, MinimalTemplateID, dir, nil, log); err != nil {
		return err
	}
	return ensureBaseTemplate(ctx, cat, cfg, log, bs)
}

// ensureBaseTemplate installs the Debian base (see ensureBaseTemplates). bs nil: a
// debootstrap build runs before it returns.
func ensureBaseTemplate(ctx context.Context, cat *catalog.Catalog, cfg config.Config, log *slog.Logger, bs *baseBuild) error {
	dir, ok, err := installedBuiltin(cat, cfg, BaseTemplateID, base.DebianBuilt, log)
	if err != nil {
		return err
	}
	if ok {
		return registerBuiltin(ctx, cat, cfg, BaseTemplateID, dir, base.DebianEnv, log)
	}
	if src := cfg.Templates.BaseRootFS; src != "" {
		if real, err := filepath.EvalSymlinks(src); err == nil {
			src = real // `make base` links bin/base-rootfs to the machine's cache
		}
		if !base.DebianBuilt(src) {
			return fmt.Errorf("--base-rootfs %s is not a finished base build (run `aenv template build-base --out %[1]s`)", src)
		}
		if err := copyTree(ctx, src, dir); err != nil {
			return fmt.Errorf("install the base rootfs from %s: %w", src, err)
		}
		return registerBuiltin(ctx, cat, cfg, BaseTemplateID, dir, base.DebianEnv, log)
	}
	build := func(ctx context.Context, progress func(string)) error {
		log.Info("building the base template with debootstrap (a few minutes, once per node)", "dir", dir,
			"packages", strings.Join(base.DebianPackages, ","))
		err := base.BuildDebian(ctx, base.DebianOptions{Out: dir, Suite: cfg.Templates.BaseSuite, Mirror: cfg.Templates.BaseMirror,
			CacheDir: filepath.Join(cfg.DataDir, "cache", "debootstrap"), Progress: progress})
		if err != nil {
			return fmt.Errorf("build the base template: %w (or build it elsewhere with `aenv template build-base` and pass --base-rootfs)", err)
		}
		return registerBuiltin(ctx, cat, cfg, BaseTemplateID, dir, base.DebianEnv, log)
	}
	if bs == nil {
		return build(ctx, func(string) {})
	}
	bs.start(build)
	return nil
}

// builtinsInstalled reports whether the catalog has both built-in templates installed by
// an earlier start: a finished tree, and its layered form when templates.layered_base.
func builtinsInstalled(cat *catalog.Catalog, cfg config.Config) bool {
	for _, b := range []struct {
		id    string
		built func(string) bool
	}{{MinimalTemplateID, base.Built}, {BaseTemplateID, base.DebianBuilt}} {
		t, err := cat.Templates().Get(b.id)
		if err != nil || !b.built(t.RootFSDir) || cfg.Templates.LayeredBase && len(t.Artifact) == 0 {
			return false
		}
	}
	return true
}

// installedBuiltin returns the rootfs directory of built-in template id and whether the
// catalog has a finished build of it there.
func installedBuiltin(cat *catalog.Catalog, cfg config.Config, id string, built func(string) bool, log *slog.Logger) (string, bool, error) {
	dir := filepath.Join(cfg.DataDir, "templates", id, "rootfs")
	t, err := cat.Templates().Get(id)
	switch {
	case err == nil && built(t.RootFSDir):
		return t.RootFSDir, true, nil
	case err == nil:
		// Missing, or built by an older aenv: sandboxes already running keep the old
		// tree's inodes, new ones get the new build.
		log.Warn("built-in template's rootfs is missing or outdated; reinstalling it", "template", id, "dir", t.RootFSDir)
		return dir, false, nil
	case errors.Is(err, catalog.ErrNotFound):
		return dir, false, nil
	default:
		return "", false, fmt.Errorf("look up the %s template: %w", id, err)
	}
}

// registerBuiltin makes the layered form of built-in template id's rootfs dir and puts
// the template, with environment env, in the catalog (unchanged entries are left alone).
func registerBuiltin(ctx context.Context, cat *catalog.Catalog, cfg config.Config, id, dir string, env map[string]string,
	log *slog.Logger) error {
	var art json.RawMessage
	if cfg.Templates.LayeredBase {
		art = layeredBase(ctx, cfg, id, dir, log)
	}
	t, err := cat.Templates().Get(id)
	if err != nil && !errors.Is(err, catalog.ErrNotFound) {
		return fmt.Errorf("look up the %s template: %w", id, err)
	}
	if err == nil && t.RootFSDir == dir && bytes.Equal(t.Artifact, art) && maps.Equal(t.EnvVars, env) {
		return nil
	}
	if err := cat.Templates().Put(catalog.Template{
		ID:             id,
		Kind:           catalog.KindTemplate,
		RootFSDir:      dir,
		DefaultUser:    "user",
		DefaultWorkdir: "/home/user",
		EnvVars:        env,
		Artifact:       art,
		CreatedAt:      t.CreatedAt,
	}); err != nil {
		return fmt.Errorf("register the %s template: %w", id, err)
	}
	log.Info("built-in template ready", "template", id, "dir", dir, "layered", art != nil)
	return nil
}

// layeredBase returns the base template's layered artifact (made once per rootfs version
// and disk size, and checked to mount through FUSE and a loop device on this host), or
// nil, with a warning, where it cannot be made or used.
func layeredBase(ctx context.Context, cfg config.Config, id, dir string, log *slog.Logger) json.RawMessage {
	out := filepath.Join(cfg.DataDir, "templates", id, "layered")
	res, err := layered.Build(ctx, dir, out, cfg.Sandbox.DefaultDiskMB)
	if err == nil {
		err = layered.VerifyOnce(ctx, res.Manifest, filepath.Join(out, ".verify"))
	}
	if err != nil {
		log.Warn("built-in template stays a directory template: snapshot, fork and pause to disk of its sandboxes are unavailable",
			"template", id, "err", err)
		return nil
	}
	if res.Built {
		log.Info("built the layered built-in template", "template", id, "dir", out, "elapsed", res.Elapsed.Round(time.Millisecond))
	}
	return res.Artifact
}

// copyTree copies src to dst with `cp -a` (ownership, modes, links and devices as they
// are), through a temporary sibling so dst is either complete or absent. On the same
// filesystem it hard-links the files instead (a Debian base is ~15k files and 400 MB):
// template trees are only ever read (sandboxes see them as read-only lowers, through
// idmapped mounts, never chowned), and a rebuilt source is renamed into place, so the
// installed copy never changes under the node.
func copyTree(ctx context.Context, src, dst string) error {
	if err := os.MkdirAll(filepath.Dir(dst), 0o755); err != nil {
		return err
	}
	tmp := dst + ".tmp"
	if err := os.RemoveAll(tmp); err != nil {
		return err
	}
	if err := exec.CommandContext(ctx, "cp", "-al", src, tmp).Run(); err != nil {
		os.RemoveAll(tmp)
		if out, err := exec.CommandContext(ctx, "cp", "-a", src, tmp).CombinedOutput(); err != nil {
			os.RemoveAll(tmp)
			return fmt.Errorf("cp -a: %w: %s", err, out)
		}
	}
	if err := os.RemoveAll(dst); err != nil {
		return err
	}
	return os.Rename(tmp, dst)
}

// LayeredTemplate reports whether template id runs on layered block roots, which is
// what makes converting pulled images worth its cost on this node.
func LayeredTemplate(cat *catalog.Catalog, id string) bool {
	t, err := cat.Templates().Get(id)
	if err != nil {
		return false
	}
	return t.Layered()
}
