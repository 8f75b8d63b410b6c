package build

import (
	"bytes"
	"context"
	"io"
	"os"
	"path/filepath"
	"strings"
	"testing"

	v1 "github.com/google/go-containerregistry/pkg/v1"
	"github.com/google/go-containerregistry/pkg/v1/empty"
	"github.com/google/go-containerregistry/pkg/v1/layout"
	"github.com/google/go-containerregistry/pkg/v1/mutate"
	"github.com/google/go-containerregistry/pkg/v1/tarball"
	"github.com/google/go-containerregistry/pkg/v1/types"

	"github.com/aenv-dev/aenv/internal/image"
	"github.com/aenv-dev/aenv/test/debian"
)

// dirLayer tars a directory tree (as an image layer) with its ownership and modes.
func dirLayer(t testing.TB, dir string) []byte {
	t.Helper()
	b, err := debian.TarDir(dir)
	if err != nil {
		t.Fatal(err)
	}
	return b
}

// baseImage writes an OCI layout holding one image made of n's base rootfs, with the
// configuration edit makes, and returns its directory.
func baseImage(t testing.TB, n *realNode, edit func(*v1.Config)) string {
	t.Helper()
	b := dirLayer(t, filepath.Join(n.data, "templates", "base", "rootfs"))
	l, err := tarball.LayerFromOpener(func() (io.ReadCloser, error) { return io.NopCloser(bytes.NewReader(b)), nil },
		tarball.WithMediaType(types.OCILayer))
	if err != nil {
		t.Fatal(err)
	}
	img, err := mutate.AppendLayers(empty.Image, l)
	if err != nil {
		t.Fatal(err)
	}
	cf, _ := img.ConfigFile()
	cf = cf.DeepCopy()
	cf.OS, cf.Architecture = "linux", image.HostPlatform().Architecture
	cf.Config.Env = []string{"PATH=/usr/local/bin:/usr/bin:/bin", "FROM_IMAGE=yes"}
	if edit != nil {
		edit(&cf.Config)
	}
	img, err = mutate.ConfigFile(mutate.MediaType(img, types.OCIManifestSchema1), cf)
	if err != nil {
		t.Fatal(err)
	}
	dir := filepath.Join(t.TempDir(), "layout")
	lp, err := layout.Write(dir, empty.Index)
	if err != nil {
		t.Fatal(err)
	}
	if err := lp.AppendImage(img); err != nil {
		t.Fatal(err)
	}
	return dir
}

// TestBuildFromImage pulls an image from an OCI layout made of the base rootfs, imports
// it once and builds on it twice (the second build reuses the import).
func TestBuildFromImage(t *testing.T) {
	n := newRealNode(t, Config{})
	dir := baseImage(t, n, nil)
	for i, name := range []string{"from-image-1", "from-image-2"} {
		rec := n.build(t, name, Spec{FromImage: "oci:" + dir, Steps: []Step{{Type: StepRun, Args: []string{`echo "$FROM_IMAGE" > /home/user/env.txt`}}}})
		if rec.Status != StatusReady {
			t.Fatalf("build %s: %+v\n%s", rec.Status, rec.Reason, n.logText(rec.ID))
		}
		logs := n.logText(rec.ID)
		if want := []string{"imported as img-", "already imported as img-"}[i]; !strings.Contains(logs, want) {
			t.Errorf("build %d log lacks %q:\n%s", i+1, want, logs)
		}
		tpl, err := n.svc.Resolve(name)
		if err != nil {
			t.Fatal(err)
		}
		if got, err := os.ReadFile(filepath.Join(tpl.RootFSDir, "home/user/env.txt")); err != nil || string(got) != "yes\n" {
			t.Errorf("env.txt = %q, %v", got, err)
		}
	}
	// The import is a template of its own, listed with the others.
	ts, err := n.svc.Templates()
	if err != nil {
		t.Fatal(err)
	}
	imports := 0
	for _, tp := range ts {
		if strings.HasPrefix(tp.ID, "img-") {
			imports++
		}
	}
	if imports != 1 {
		t.Errorf("%d image imports, want 1", imports)
	}
	// Deleting a built template removes its files; the import stays.
	tpl, _ := n.svc.Resolve("from-image-1")
	if _, err := n.svc.Delete(context.Background(), "from-image-1"); err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(filepath.Join(n.data, "templates", tpl.ID)); !os.IsNotExist(err) {
		t.Errorf("deleted template's files remain: %v", err)
	}
	if len(n.svc.Builds(tpl.ID)) != 0 {
		t.Error("deleted template's builds remain")
	}
	n.noSandboxes(t)
}
