package install

import (
	"context"
	"encoding/json"
	"errors"
	"os"
	"path/filepath"
	"testing"

	"github.com/aenv-dev/aenv/internal/catalog"
	"github.com/aenv-dev/aenv/internal/image"
	"github.com/aenv-dev/aenv/internal/image/imagetest"
	"github.com/aenv-dev/aenv/internal/sandbox"
	v1 "github.com/google/go-containerregistry/pkg/v1"
)

// ociLayout writes a one-layer image with an entrypoint and env to a layout.
func ociLayout(t *testing.T) string {
	t.Helper()
	return imagetest.Layout(t, filepath.Join(t.TempDir(), "my-app"), image.HostPlatform().Architecture, func(c *v1.Config) {
		c.Env = []string{"A=1", "PATH=/bin"}
		c.Entrypoint = []string{"/bin/app"}
		c.Cmd = []string{"--name", "it's"}
	}, imagetest.File{Name: "bin/app", Body: "#!/bin/sh\n", Mode: 0o755}, imagetest.File{Name: "bin/sh", Body: "#!", Mode: 0o755},
		imagetest.File{Name: "etc/passwd", Body: "root:x:0:0::/root:/bin/sh\n", Mode: 0o755})
}

func TestRun(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("needs root: unpacking sets ownership")
	}
	ctx := context.Background()
	data := t.TempDir()
	cat, err := catalog.Open(filepath.Join(data, "aenv.db"))
	if err != nil {
		t.Fatal(err)
	}
	defer cat.Close()
	ref := "oci:" + ociLayout(t)
	tpl, err := Run(ctx, cat.Templates(), Request{Ref: ref, DataDir: data, StartFromImage: true,
		Resources: sandbox.Resources{CPUCount: 2, MemoryMB: 512}})
	if err != nil {
		t.Fatal(err)
	}
	got, err := cat.Templates().Resolve("my-app")
	if err != nil || got.ID != tpl.ID {
		t.Fatalf("resolve alias: %+v, %v", got, err)
	}
	if got.RootFSDir != filepath.Join(data, TemplatesDir, tpl.ID, image.RootFSName) ||
		got.EnvVars["A"] != "1" || got.StartCmd != `/bin/app --name 'it'"'"'s'` ||
		got.DefaultUser != "user" || got.DefaultWorkdir != "/home/user" || got.Resources.CPUCount != 2 {
		t.Errorf("template = %+v", got)
	}
	if b, err := os.ReadFile(filepath.Join(got.RootFSDir, "bin/app")); err != nil || string(b) != "#!/bin/sh\n" {
		t.Errorf("rootfs bin/app = %q, %v", b, err)
	}
	var art image.Artifact
	if err := json.Unmarshal(got.Artifact, &art); err != nil || art.Kind != image.ArtifactKind || len(art.Layers) != 1 {
		t.Errorf("artifact = %s (%v)", got.Artifact, err)
	}

	// The same name again is refused before anything is pulled or written.
	_, err = Run(ctx, cat.Templates(), Request{Ref: ref, DataDir: data})
	if !errors.Is(err, catalog.ErrAliasTaken) {
		t.Errorf("second install: err = %v, want ErrAliasTaken", err)
	}
	if ents, _ := os.ReadDir(filepath.Join(data, TemplatesDir)); len(ents) != 1 {
		t.Errorf("templates dir holds %d entries", len(ents))
	}
	// A failing pull registers nothing.
	_, err = Run(ctx, cat.Templates(), Request{Ref: "oci:" + filepath.Join(data, "nope"), DataDir: data, Name: "x"})
	if err == nil {
		t.Error("missing layout installed")
	}
	if _, err := cat.Templates().Resolve("x"); !errors.Is(err, catalog.ErrNotFound) {
		t.Errorf("failed install registered: %v", err)
	}
}

func TestRunConvert(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("needs root (FUSE, loop, ext4)")
	}
	for _, p := range []string{"/dev/fuse", "/dev/loop-control"} {
		if _, err := os.Stat(p); err != nil {
			t.Skipf("needs %s", p)
		}
	}
	data := t.TempDir()
	cat, err := catalog.Open(filepath.Join(data, "aenv.db"))
	if err != nil {
		t.Fatal(err)
	}
	defer cat.Close()
	tpl, err := Run(context.Background(), cat.Templates(), Request{Ref: "oci:" + ociLayout(t), DataDir: data,
		Name: "conv", Convert: true, Resources: sandbox.Resources{DiskSizeMB: 64}})
	if err != nil {
		t.Fatal(err)
	}
	var art struct {
		Overlaybd struct {
			SizeMB int `json:"sizeMB"`
			Layers []struct {
				Path string `json:"path"`
			} `json:"layers"`
		} `json:"overlaybd"`
	}
	if err := json.Unmarshal(tpl.Artifact, &art); err != nil || art.Overlaybd.SizeMB != 64 || len(art.Overlaybd.Layers) != 3 { // ext4, the image, the sandbox root
		t.Fatalf("artifact = %s (%v)", tpl.Artifact, err)
	}
	for _, l := range art.Overlaybd.Layers {
		if _, err := os.Stat(l.Path); err != nil {
			t.Errorf("converted layer: %v", err)
		}
	}
}

func TestDefaultName(t *testing.T) {
	for in, want := range map[string]string{
		"ubuntu:22.04":                       "ubuntu",
		"docker.io/library/python:3.12-slim": "python",
		"127.0.0.1:5000/team/agent@sha256:0123456789012345678901234567890123456789012345678901234567890123": "agent",
		"127.0.0.1:5000/app":               "app",
		"oci:/srv/images/my-app:v1":        "my-app",
		"docker-archive:/tmp/swe.tar":      "swe",
		"oci-archive:/tmp/weird name!.tar": "weird-name",
	} {
		s, err := image.ParseReference(in)
		if err != nil {
			t.Fatal(err)
		}
		if got := DefaultName(s); got != want {
			t.Errorf("DefaultName(%q) = %q, want %q", in, got, want)
		}
	}
	if id := NewID(); len(id) != 20 || !catalog.ValidName(id) || id == NewID() {
		t.Errorf("NewID = %q", id)
	}
}
