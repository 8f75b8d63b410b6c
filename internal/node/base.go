package node

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"os/exec"
	"path/filepath"
	"time"

	"github.com/aenv-dev/aenv/internal/catalog"
	"github.com/aenv-dev/aenv/internal/config"
	"github.com/aenv-dev/aenv/internal/template/base"
	"github.com/aenv-dev/aenv/internal/template/layered"
)

// BaseTemplateID is the template the SDKs create from by default; the node installs it
// itself on first start.
const BaseTemplateID = "base"

// ensureBaseTemplate makes sure the "base" template exists, so Sandbox.create() with the
// SDK's default template works on a fresh node: it installs the prebuilt rootfs given by
// templates.base_rootfs (copied into the data dir, so the node does not depend on a build
// tree) or builds one from the host's static binaries. It then makes the layered form of
// that rootfs (one sealed ext4 layer), so base sandboxes run on block roots that can be
// snapshotted, forked and paused to disk; where that cannot be made (no mkfs.ext4) base
// stays a directory template and those operations answer 501.
func ensureBaseTemplate(ctx context.Context, cat *catalog.Catalog, cfg config.Config, log *slog.Logger) error {
	dir := filepath.Join(cfg.DataDir, "templates", BaseTemplateID, "rootfs")
	t, err := cat.Templates().Get(BaseTemplateID)
	switch {
	case err == nil && base.Built(t.RootFSDir):
		dir = t.RootFSDir
	case err == nil || errors.Is(err, catalog.ErrNotFound):
		if err == nil {
			// Missing, or built by an older aenv: sandboxes already running keep the old
			// tree's inodes, new ones get the new build.
			log.Warn("base template's rootfs is missing or outdated; reinstalling it", "dir", t.RootFSDir)
		}
		if err := installBaseRootFS(ctx, cfg, dir, log); err != nil {
			return err
		}
	default:
		return fmt.Errorf("look up the base template: %w", err)
	}
	var art json.RawMessage
	if cfg.Templates.LayeredBase {
		art = layeredBase(ctx, cfg, dir, log)
	}
	if t.RootFSDir == dir && bytes.Equal(t.Artifact, art) {
		return nil
	}
	if err := cat.Templates().Put(catalog.Template{
		ID:             BaseTemplateID,
		Kind:           catalog.KindTemplate,
		RootFSDir:      dir,
		DefaultUser:    "user",
		DefaultWorkdir: "/home/user",
		Artifact:       art,
		CreatedAt:      t.CreatedAt,
	}); err != nil {
		return fmt.Errorf("register the base template: %w", err)
	}
	log.Info("base template ready", "dir", dir, "layered", art != nil)
	return nil
}

// installBaseRootFS puts a finished base rootfs at dir.
func installBaseRootFS(ctx context.Context, cfg config.Config, dir string, log *slog.Logger) error {
	if src := cfg.Templates.BaseRootFS; src != "" {
		if !base.Built(src) {
			return fmt.Errorf("--base-rootfs %s is not a finished base build (run `aenv template build-base --out %[1]s`)", src)
		}
		if err := copyTree(ctx, src, dir); err != nil {
			return fmt.Errorf("install the base rootfs from %s: %w", src, err)
		}
		return nil
	}
	log.Info("building the base template", "dir", dir)
	if err := base.Build(ctx, base.Options{Out: dir}); err != nil {
		return fmt.Errorf("build the base template: %w (or pass --base-rootfs)", err)
	}
	return nil
}

// layeredBase returns the base template's layered artifact (made once per rootfs version
// and disk size, and checked to mount through FUSE and a loop device on this host), or
// nil, with a warning, where it cannot be made or used.
func layeredBase(ctx context.Context, cfg config.Config, dir string, log *slog.Logger) json.RawMessage {
	out := filepath.Join(cfg.DataDir, "templates", BaseTemplateID, "layered")
	res, err := layered.Build(ctx, dir, out, cfg.Sandbox.DefaultDiskMB)
	if err == nil {
		err = layered.Verify(ctx, res.Manifest, filepath.Join(out, ".verify"))
	}
	if err != nil {
		log.Warn("base template stays a directory template: snapshot, fork and pause to disk of its sandboxes are unavailable",
			"err", err)
		return nil
	}
	if res.Built {
		log.Info("built the layered base template", "dir", out, "elapsed", res.Elapsed.Round(time.Millisecond))
	}
	return res.Artifact
}

// copyTree copies src to dst with `cp -a` (ownership, modes, links and devices as they
// are), through a temporary sibling so dst is either complete or absent.
func copyTree(ctx context.Context, src, dst string) error {
	if err := os.MkdirAll(filepath.Dir(dst), 0o755); err != nil {
		return err
	}
	tmp := dst + ".tmp"
	if err := os.RemoveAll(tmp); err != nil {
		return err
	}
	if out, err := exec.CommandContext(ctx, "cp", "-a", src, tmp).CombinedOutput(); err != nil {
		os.RemoveAll(tmp)
		return fmt.Errorf("cp -a: %w: %s", err, out)
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
