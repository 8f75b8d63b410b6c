package main

import (
	"archive/tar"
	"bytes"
	"context"
	"io"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/google/go-containerregistry/pkg/v1/empty"
	"github.com/google/go-containerregistry/pkg/v1/layout"
	"github.com/google/go-containerregistry/pkg/v1/mutate"
	"github.com/google/go-containerregistry/pkg/v1/tarball"
	"github.com/google/go-containerregistry/pkg/v1/types"

	"github.com/aenv-dev/aenv/internal/catalog"
	"github.com/aenv-dev/aenv/internal/image"
)

func pullTestLayout(t *testing.T) string {
	t.Helper()
	var buf bytes.Buffer
	tw := tar.NewWriter(&buf)
	tw.WriteHeader(&tar.Header{Name: "hello", Mode: 0o644, Size: 2, Typeflag: tar.TypeReg})
	tw.Write([]byte("hi"))
	tw.Close()
	b := buf.Bytes()
	l, err := tarball.LayerFromOpener(func() (io.ReadCloser, error) { return io.NopCloser(bytes.NewReader(b)), nil },
		tarball.WithMediaType(types.OCILayer))
	if err != nil {
		t.Fatal(err)
	}
	img, _ := mutate.AppendLayers(empty.Image, l)
	cf, _ := img.ConfigFile()
	cf = cf.DeepCopy()
	cf.OS, cf.Architecture = "linux", image.HostPlatform().Architecture
	img, _ = mutate.ConfigFile(mutate.MediaType(img, types.OCIManifestSchema1), cf)
	dir := t.TempDir()
	lp, _ := layout.Write(dir, empty.Index)
	if err := lp.AppendImage(img); err != nil {
		t.Fatal(err)
	}
	return dir
}

func runPull(t *testing.T, args ...string) (string, string, error) {
	t.Helper()
	cmd := newPullCmd()
	var out, errOut bytes.Buffer
	cmd.SetOut(&out)
	cmd.SetErr(&errOut)
	cmd.SetArgs(args)
	err := cmd.ExecuteContext(context.Background())
	return out.String(), errOut.String(), err
}

func TestPullCmd(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("needs root: unpacking sets ownership")
	}
	data := t.TempDir()
	ref := "oci:" + pullTestLayout(t)
	out, progress, err := runPull(t, ref, "--data-dir", data, "--name", "hello", "--cpu", "2", "--probe", "8080")
	if err != nil {
		t.Fatalf("%v\n%s", err, progress)
	}
	if !strings.Contains(progress, "download layer 1/1") || !strings.Contains(progress, "apply    layer 1/1") {
		t.Errorf("piped progress lines missing:\n%s", progress)
	}
	id := strings.Fields(out)[0]
	cat, err := catalog.Open(filepath.Join(data, catalogFile))
	if err != nil {
		t.Fatal(err)
	}
	tpl, err := cat.Templates().Resolve("hello")
	if err != nil || tpl.ID != id || tpl.ReadyCmd != ": >/dev/tcp/127.0.0.1/8080" || tpl.Resources.CPUCount != 2 {
		t.Errorf("template = %+v, %v", tpl, err)
	}
	// While the catalog is held (as by a running `aenv serve`), pull refuses
	// and says what to do instead.
	_, _, err = runPull(t, ref, "--data-dir", data, "--name", "other")
	cat.Close()
	if err == nil || !strings.Contains(err.Error(), "aenv serve") {
		t.Errorf("pull with a busy catalog: %v", err)
	}
	if _, _, err := runPull(t, ref, "--data-dir", data, "--probe", "1", "--ready-cmd", "true"); err == nil {
		t.Error("--probe with --ready-cmd accepted")
	}
}

func TestPullProgressTTY(t *testing.T) {
	var buf bytes.Buffer
	p := newPullProgress(&buf, true)
	p.report(image.Progress{Phase: image.PhaseDownload, Layer: 1, Layers: 2, Digest: "sha256:0123456789abcdef0123", Done: 1 << 20, Total: 3 << 20})
	p.report(image.Progress{Phase: image.PhaseDownload, Layer: 2, Layers: 2, Digest: "sha256:ff", Cached: true, Final: true})
	p.finish()
	got := buf.String()
	if !strings.Contains(got, "\r\033[K") || !strings.Contains(got, "1.0 MiB / 3.0 MiB") || !strings.HasSuffix(got, "cached\n") {
		t.Errorf("tty output = %q", got)
	}
}
