package main

import (
	"context"
	"io"
	"log/slog"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/aenv-dev/aenv/internal/catalog"
	"github.com/aenv-dev/aenv/internal/config"
	"github.com/aenv-dev/aenv/internal/template/base"
)

func TestEnsureBaseTemplateFromPrebuiltRootfs(t *testing.T) {
	src := t.TempDir()
	os.MkdirAll(filepath.Join(src, "home", "user"), 0o755)
	os.WriteFile(filepath.Join(src, "marker"), []byte("prebuilt"), 0o644)
	os.WriteFile(filepath.Join(src, base.StampFile), []byte(base.Version+"\n"), 0o644)
	dataDir := t.TempDir()
	cat, err := catalog.Open(filepath.Join(dataDir, catalogFile))
	if err != nil {
		t.Fatal(err)
	}
	defer cat.Close()
	cfg := config.Default()
	cfg.DataDir = dataDir
	cfg.Templates.BaseRootFS = src
	log := slog.New(slog.NewTextHandler(io.Discard, nil))

	if err := ensureBaseTemplate(context.Background(), cat, cfg, log); err != nil {
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
	// Installed and current: a second start changes nothing, even without the source.
	os.RemoveAll(src)
	os.WriteFile(filepath.Join(tpl.RootFSDir, "marker"), []byte("kept"), 0o644)
	if err := ensureBaseTemplate(context.Background(), cat, cfg, log); err != nil {
		t.Fatal(err)
	}
	if b, _ := os.ReadFile(filepath.Join(tpl.RootFSDir, "marker")); string(b) != "kept" {
		t.Fatal("an installed base template was reinstalled")
	}
}

func TestEnsureBaseTemplateRejectsUnfinishedBuild(t *testing.T) {
	dataDir := t.TempDir()
	cat, err := catalog.Open(filepath.Join(dataDir, catalogFile))
	if err != nil {
		t.Fatal(err)
	}
	defer cat.Close()
	cfg := config.Default()
	cfg.DataDir = dataDir
	cfg.Templates.BaseRootFS = t.TempDir() // no stamp
	err = ensureBaseTemplate(context.Background(), cat, cfg, slog.New(slog.NewTextHandler(io.Discard, nil)))
	if err == nil || !strings.Contains(err.Error(), "build-base") {
		t.Fatalf("err = %v", err)
	}
	if _, err := cat.Templates().Get("base"); err == nil {
		t.Fatal("a failed install registered the template")
	}
}

func TestFindEnvd(t *testing.T) {
	dir := t.TempDir()
	exe := filepath.Join(dir, "envd")
	os.WriteFile(exe, []byte("#!/bin/sh\n"), 0o755)
	if got, err := findEnvd(exe); err != nil || got != exe {
		t.Fatalf("findEnvd = %q, %v", got, err)
	}
	noexec := filepath.Join(dir, "plain")
	os.WriteFile(noexec, nil, 0o644)
	for _, p := range []string{noexec, dir, filepath.Join(dir, "missing")} {
		if _, err := findEnvd(p); err == nil || !strings.Contains(err.Error(), "--envd") {
			t.Errorf("findEnvd(%s) err = %v", p, err)
		}
	}
}
