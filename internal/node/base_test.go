package node

import (
	"context"
	"encoding/json"
	"io"
	"log/slog"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"

	"github.com/aenv-dev/aenv/internal/catalog"
	"github.com/aenv-dev/aenv/internal/config"
	"github.com/aenv-dev/aenv/internal/template/base"
	"github.com/aenv-dev/aenv/internal/template/layered"
)

// baseFixture is a prebuilt (stamped) base rootfs, an empty data dir and its catalog. The
// node treats a prebuilt base as opaque beyond its stamp, so a tree with the Debian
// base's stamp stands for one here (test/e2e checks the real thing).
func baseFixture(t *testing.T) (*catalog.Catalog, config.Config) {
	t.Helper()
	src := t.TempDir()
	os.MkdirAll(filepath.Join(src, "home", "user"), 0o755)
	os.WriteFile(filepath.Join(src, base.StampFile), []byte(base.DebianVersion+"\n"), 0o644)
	dataDir := t.TempDir()
	cat, err := catalog.Open(filepath.Join(dataDir, CatalogFile))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { cat.Close() })
	cfg := config.Default()
	cfg.DataDir = dataDir
	cfg.Templates.BaseRootFS = src
	cfg.Sandbox.DefaultDiskMB = 64 // keeps mkfs quick; the real default is 2048
	return cat, cfg
}

func baseTemplate(t *testing.T, cat *catalog.Catalog) catalog.Template {
	t.Helper()
	tpl, err := cat.Templates().Get(BaseTemplateID)
	if err != nil {
		t.Fatal(err)
	}
	return tpl
}

func TestEnsureBaseTemplateIsLayered(t *testing.T) {
	if _, err := exec.LookPath("mkfs.ext4"); err != nil {
		t.Skip("needs mkfs.ext4 (e2fsprogs)")
	}
	if os.Geteuid() != 0 {
		t.Skip("needs root (the layered base is checked through FUSE and a loop device)")
	}
	for _, p := range []string{"/dev/fuse", "/dev/loop-control"} {
		if _, err := os.Stat(p); err != nil {
			t.Skipf("needs %s", p)
		}
	}
	cat, cfg := baseFixture(t)
	log := slog.New(slog.NewTextHandler(io.Discard, nil))
	ctx := context.Background()

	// A node whose catalog has the directory-only base of an older aenv gets it upgraded.
	dir := filepath.Join(cfg.DataDir, "templates", BaseTemplateID, "rootfs")
	if err := copyTree(ctx, cfg.Templates.BaseRootFS, dir); err != nil {
		t.Fatal(err)
	}
	if err := cat.Templates().Put(catalog.Template{ID: BaseTemplateID, Kind: catalog.KindTemplate, RootFSDir: dir}); err != nil {
		t.Fatal(err)
	}
	if err := ensureBaseTemplate(ctx, cat, cfg, log, nil); err != nil {
		t.Fatal(err)
	}
	tpl := baseTemplate(t, cat)
	ls, err := tpl.Layers()
	if err != nil {
		t.Fatal(err)
	}
	if tpl.RootFSDir != dir || ls == nil || len(ls.Layers) != 1 || ls.SizeMB != 64 {
		t.Fatalf("base template = %+v, layers %+v", tpl, ls)
	}
	if _, err := os.Stat(ls.Layers[0].Path); err != nil {
		t.Fatal(err)
	}
	var a layered.Artifact
	if err := json.Unmarshal(tpl.Artifact, &a); err != nil || a.Kind != layered.ArtifactKind {
		t.Fatalf("artifact %s: %v", tpl.Artifact, err)
	}

	// A restart changes nothing.
	if err := ensureBaseTemplate(ctx, cat, cfg, log, nil); err != nil {
		t.Fatal(err)
	}
	if again := baseTemplate(t, cat); string(again.Artifact) != string(tpl.Artifact) || !again.CreatedAt.Equal(tpl.CreatedAt) {
		t.Fatalf("restart changed the base template: %s -> %s", tpl.Artifact, again.Artifact)
	}
}

// Without mkfs.ext4 the base stays a directory template and the node still starts.
func TestEnsureBaseTemplateFallsBackToDirectory(t *testing.T) {
	cp, err := exec.LookPath("cp")
	if err != nil {
		t.Skip("needs cp")
	}
	bin := t.TempDir()
	if err := os.Symlink(cp, filepath.Join(bin, "cp")); err != nil {
		t.Fatal(err)
	}
	t.Setenv("PATH", bin) // cp for the install, no mkfs.ext4
	cat, cfg := baseFixture(t)
	if err := ensureBaseTemplate(context.Background(), cat, cfg, slog.New(slog.NewTextHandler(io.Discard, nil)), nil); err != nil {
		t.Fatal(err)
	}
	tpl := baseTemplate(t, cat)
	if tpl.Artifact != nil || !base.DebianBuilt(tpl.RootFSDir) {
		t.Fatalf("base template = %+v", tpl)
	}
	if tpl.Layered() {
		t.Fatalf("directory base is layered: %s", tpl.Artifact)
	}
}

func TestEnsureBaseTemplateFromPrebuiltRootfs(t *testing.T) {
	src := t.TempDir()
	os.MkdirAll(filepath.Join(src, "home", "user"), 0o755)
	os.WriteFile(filepath.Join(src, "marker"), []byte("prebuilt"), 0o644)
	os.WriteFile(filepath.Join(src, base.StampFile), []byte(base.DebianVersion+"\n"), 0o644)
	dataDir := t.TempDir()
	cat, err := catalog.Open(filepath.Join(dataDir, CatalogFile))
	if err != nil {
		t.Fatal(err)
	}
	defer cat.Close()
	cfg := config.Default()
	cfg.DataDir = dataDir
	cfg.Templates.BaseRootFS = src
	log := slog.New(slog.NewTextHandler(io.Discard, nil))

	if err := ensureBaseTemplate(context.Background(), cat, cfg, log, nil); err != nil {
		t.Fatal(err)
	}
	tpl, err := cat.Templates().Resolve("base")
	if err != nil {
		t.Fatal(err)
	}
	if !strings.HasPrefix(tpl.RootFSDir, dataDir) || tpl.DefaultUser != "user" {
		t.Fatalf("template = %+v", tpl)
	}
	if b, _ := os.ReadFile(filepath.Join(tpl.RootFSDir, "marker")); string(b) != "prebuilt" {
		t.Fatal("the prebuilt rootfs was not copied into the data dir")
	}
	// Same filesystem: installed by hard links, not by copying 400 MB.
	a, _ := os.Stat(filepath.Join(src, "marker"))
	b, _ := os.Stat(filepath.Join(tpl.RootFSDir, "marker"))
	if a == nil || b == nil || !os.SameFile(a, b) {
		t.Fatal("the prebuilt rootfs was copied, not hard-linked")
	}
	os.Remove(filepath.Join(tpl.RootFSDir, "marker")) // the source's file stays
	// Installed and current: a second start changes nothing, even without the source.
	if b, _ := os.ReadFile(filepath.Join(src, "marker")); string(b) != "prebuilt" {
		t.Fatal("the source changed with the installed copy")
	}
	os.RemoveAll(src)
	os.WriteFile(filepath.Join(tpl.RootFSDir, "marker"), []byte("kept"), 0o644)
	if err := ensureBaseTemplate(context.Background(), cat, cfg, log, nil); err != nil {
		t.Fatal(err)
	}
	if b, _ := os.ReadFile(filepath.Join(tpl.RootFSDir, "marker")); string(b) != "kept" {
		t.Fatal("an installed base template was reinstalled")
	}
}

func TestEnsureBaseTemplateRejectsUnfinishedBuild(t *testing.T) {
	for name, stamp := range map[string]string{"no stamp": "", "a base-minimal build": base.Version} {
		t.Run(name, func(t *testing.T) {
			dataDir := t.TempDir()
			cat, err := catalog.Open(filepath.Join(dataDir, CatalogFile))
			if err != nil {
				t.Fatal(err)
			}
			defer cat.Close()
			cfg := config.Default()
			cfg.DataDir = dataDir
			cfg.Templates.BaseRootFS = t.TempDir()
			if stamp != "" {
				os.WriteFile(filepath.Join(cfg.Templates.BaseRootFS, base.StampFile), []byte(stamp+"\n"), 0o644)
			}
			err = ensureBaseTemplate(context.Background(), cat, cfg, slog.New(slog.NewTextHandler(io.Discard, nil)), nil)
			if err == nil || !strings.Contains(err.Error(), "build-base") {
				t.Fatalf("err = %v", err)
			}
			if _, err := cat.Templates().Get("base"); err == nil {
				t.Fatal("a failed install registered the template")
			}
		})
	}
}

// needMinimal skips unless base-minimal can be built here (root, busybox-static, bash-static).
func needMinimal(t *testing.T) {
	t.Helper()
	if os.Geteuid() != 0 {
		t.Skip("needs root (base-minimal's home/user belongs to uid 1000)")
	}
	for _, p := range []string{"/bin/busybox", "/bin/bash-static"} {
		if _, err := os.Stat(p); err != nil {
			t.Skipf("needs %s (busybox-static, bash-static)", p)
		}
	}
}

// Both built-in templates: base-minimal from the host's static binaries, base from the
// prebuilt rootfs; a restart reuses both.
func TestEnsureBaseTemplatesInstallsBoth(t *testing.T) {
	needMinimal(t)
	cat, cfg := baseFixture(t)
	cfg.Templates.LayeredBase = false
	log := slog.New(slog.NewTextHandler(io.Discard, nil))
	bs := newBaseBuild(log)
	if err := ensureBaseTemplates(context.Background(), cat, cfg, log, bs); err != nil {
		t.Fatal(err)
	}
	min, err := cat.Templates().Get(MinimalTemplateID)
	if err != nil || !base.Built(min.RootFSDir) || min.DefaultUser != "user" {
		t.Fatalf("base-minimal = %+v, %v", min, err)
	}
	if fi, err := os.Lstat(filepath.Join(min.RootFSDir, "bin", "busybox")); err != nil || !fi.Mode().IsRegular() {
		t.Fatalf("base-minimal has no busybox: %v", err)
	}
	if tpl := baseTemplate(t, cat); !base.DebianBuilt(tpl.RootFSDir) || tpl.EnvVars["TERM"] != "xterm-256color" {
		t.Fatalf("base = %+v", tpl)
	}
	if err := bs.pending(BaseTemplateID); err != nil {
		t.Fatalf("no build ran, yet base is pending: %v", err)
	}
	if err := ensureBaseTemplates(context.Background(), cat, cfg, log, bs); err != nil {
		t.Fatal(err)
	}
	if again, _ := cat.Templates().Get(MinimalTemplateID); !again.CreatedAt.Equal(min.CreatedAt) || again.RootFSDir != min.RootFSDir {
		t.Fatalf("restart changed base-minimal: %+v -> %+v", min, again)
	}
}
