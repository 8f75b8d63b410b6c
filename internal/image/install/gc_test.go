package install

import (
	"archive/tar"
	"bytes"
	"context"
	"encoding/json"
	"io"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/google/go-containerregistry/pkg/v1/empty"
	"github.com/google/go-containerregistry/pkg/v1/layout"
	"github.com/google/go-containerregistry/pkg/v1/mutate"
	"github.com/google/go-containerregistry/pkg/v1/tarball"
	"github.com/google/go-containerregistry/pkg/v1/types"

	v1 "github.com/google/go-containerregistry/pkg/v1"

	"github.com/aenv-dev/aenv/internal/catalog"
	"github.com/aenv-dev/aenv/internal/image"
	"github.com/aenv-dev/aenv/internal/sandbox"
)

// tarLayer makes an OCI layer holding files (name → body).
func tarLayer(t *testing.T, files map[string]string) v1.Layer {
	t.Helper()
	var buf bytes.Buffer
	tw := tar.NewWriter(&buf)
	for _, n := range slices.Sorted(func(yield func(string) bool) {
		for k := range files {
			if !yield(k) {
				return
			}
		}
	}) {
		tw.WriteHeader(&tar.Header{Name: n, Mode: 0o755, Size: int64(len(files[n])), Typeflag: tar.TypeReg})
		tw.Write([]byte(files[n]))
	}
	tw.Close()
	b := buf.Bytes()
	l, err := tarball.LayerFromOpener(func() (io.ReadCloser, error) { return io.NopCloser(bytes.NewReader(b)), nil },
		tarball.WithMediaType(types.OCILayer))
	if err != nil {
		t.Fatal(err)
	}
	return l
}

// imageLayout writes an image of layers (and USER user) to an OCI layout named name.
func imageLayout(t *testing.T, name, user string, layers ...v1.Layer) string {
	t.Helper()
	img, err := mutate.AppendLayers(empty.Image, layers...)
	if err != nil {
		t.Fatal(err)
	}
	cf, _ := img.ConfigFile()
	cf = cf.DeepCopy()
	cf.OS, cf.Architecture = "linux", image.HostPlatform().Architecture
	cf.Config.User = user
	img, _ = mutate.ConfigFile(mutate.MediaType(img, types.OCIManifestSchema1), cf)
	dir := filepath.Join(t.TempDir(), name)
	lp, err := layout.Write(dir, empty.Index)
	if err != nil {
		t.Fatal(err)
	}
	if err := lp.AppendImage(img); err != nil {
		t.Fatal(err)
	}
	return dir
}

func needConvert(t *testing.T) {
	t.Helper()
	if os.Geteuid() != 0 {
		t.Skip("needs root (FUSE, loop, ext4)")
	}
	for _, p := range []string{"/dev/fuse", "/dev/loop-control"} {
		if _, err := os.Stat(p); err != nil {
			t.Skipf("needs %s", p)
		}
	}
}

// files lists the names in dir with suffix ext.
func files(t *testing.T, dir, ext string) []string {
	t.Helper()
	ents, err := os.ReadDir(dir)
	if err != nil && !os.IsNotExist(err) {
		t.Fatal(err)
	}
	var out []string
	for _, e := range ents {
		if strings.HasSuffix(e.Name(), ext) && !strings.HasPrefix(e.Name(), ".") {
			out = append(out, e.Name())
		}
	}
	return out
}

type overlaybdArt struct {
	Overlaybd struct {
		Layers []sandbox.LayerRef `json:"layers"`
	} `json:"overlaybd"`
}

func layersOf(t *testing.T, tpl catalog.Template) []sandbox.LayerRef {
	t.Helper()
	var a overlaybdArt
	if err := json.Unmarshal(tpl.Artifact, &a); err != nil || len(a.Overlaybd.Layers) == 0 {
		t.Fatalf("artifact of %s: %s (%v)", tpl.ID, tpl.Artifact, err)
	}
	return a.Overlaybd.Layers
}

func gcNow(t *testing.T, cat *catalog.Catalog, data string) GCResult {
	t.Helper()
	all, err := cat.Templates().List("")
	if err != nil {
		t.Fatal(err)
	}
	res, err := GC(context.Background(), GCOptions{DataDir: data, Templates: all, Grace: time.Nanosecond})
	if err != nil {
		t.Fatal(err)
	}
	return res
}

func exist(t *testing.T, refs ...sandbox.LayerRef) {
	t.Helper()
	for _, r := range refs {
		if _, err := os.Stat(r.Path); err != nil {
			t.Errorf("layer %s was collected: %v", filepath.Base(r.Path), err)
		}
	}
}

func gone(t *testing.T, refs ...sandbox.LayerRef) {
	t.Helper()
	for _, r := range refs {
		if _, err := os.Stat(r.Path); !os.IsNotExist(err) {
			t.Errorf("layer %s is still there (%v)", filepath.Base(r.Path), err)
		}
	}
}

// TestGCSharedBase: two pulled images share their base layer. Deleting one frees its own
// converted layer and blob and keeps the shared ones; a snapshot of a sandbox of the
// other (naming its lowers by path, and one by digest only) keeps them after that
// template is deleted too; once the snapshot goes, everything is freed.
func TestGCSharedBase(t *testing.T) {
	needConvert(t)
	ctx := context.Background()
	data := t.TempDir()
	cat, err := catalog.Open(filepath.Join(data, "aenv.db"))
	if err != nil {
		t.Fatal(err)
	}
	defer cat.Close()
	base := tarLayer(t, map[string]string{"etc/passwd": "root:x:0:0::/root:/bin/sh\n", "bin/base": "base\n", "bin/sh": "#!"})
	a := imageLayout(t, "a", "", base, tarLayer(t, map[string]string{"srv/a": "a\n"}))
	b := imageLayout(t, "b", "", base, tarLayer(t, map[string]string{"srv/b": "b\n"}))
	res := sandbox.Resources{DiskSizeMB: 64}
	ta, err := Run(ctx, cat.Templates(), Request{Ref: "oci:" + a, DataDir: data, Convert: true, Resources: res})
	if err != nil {
		t.Fatal(err)
	}
	tb, err := Run(ctx, cat.Templates(), Request{Ref: "oci:" + b, DataDir: data, Convert: true, Resources: res})
	if err != nil {
		t.Fatal(err)
	}
	la, lb := layersOf(t, ta), layersOf(t, tb)
	// ext4, the shared base, the image's own layer, the sandbox root layer.
	if len(la) != 4 || la[0] != lb[0] || la[1] != lb[1] || la[2].Path == lb[2].Path || la[3].Path == lb[3].Path {
		t.Fatalf("stacks do not share their base: %+v / %+v", la, lb)
	}
	odir := filepath.Join(data, OverlaybdDir)
	blobs := filepath.Join(data, ImagesDir, "layers", "sha256")
	if n := len(files(t, odir, ".zfile")); n != 6 {
		t.Fatalf("%d converted layers, want 6 (ext4, base, a, b and their sandbox root layers)", n)
	}
	// A crash's leftover conversion is garbage too.
	if err := os.WriteFile(filepath.Join(odir, ".deadbeef.tmp"), []byte("x"), 0o644); err != nil {
		t.Fatal(err)
	}

	if r := gcNow(t, cat, data); len(r.Layers)+len(r.Blobs) != 0 {
		t.Fatalf("GC with both templates removed %v %v", r.Layers, r.Blobs)
	}
	if _, err := os.Stat(filepath.Join(odir, ".deadbeef.tmp")); !os.IsNotExist(err) {
		t.Errorf("stale conversion scratch kept: %v", err)
	}

	if _, err := cat.Templates().Delete(ta.ID); err != nil {
		t.Fatal(err)
	}
	r := gcNow(t, cat, data)
	gone(t, la[2], la[3])
	exist(t, lb...)
	if len(r.Layers) != 2 || len(r.Blobs) != 1 || len(files(t, blobs, "")) != 2 {
		t.Errorf("after deleting a: removed layers %v blobs %v; blobs left %v", r.Layers, r.Blobs, files(t, blobs, ""))
	}

	// A snapshot of a sandbox of b: its capture lists b's stack (the top layer by digest
	// only, as once published) plus its own sealed layer.
	capLayers := append(slices.Clone(lb[:3]), sandbox.LayerRef{Digest: lb[3].Digest, Size: lb[3].Size},
		sandbox.LayerRef{Path: filepath.Join(data, "oci", "layers", "snap.commit")})
	capture, _ := json.Marshal(map[string]any{"version": 1, "backend": "oci", "id": "snap1", "layers": capLayers})
	if err := cat.Templates().Put(catalog.Template{ID: "snap1", Kind: catalog.KindSnapshot, Backend: "oci", Artifact: capture}); err != nil {
		t.Fatal(err)
	}
	if _, err := cat.Templates().Delete(tb.ID); err != nil {
		t.Fatal(err)
	}
	gcNow(t, cat, data)
	exist(t, lb...)

	if _, err := cat.Templates().Delete("snap1"); err != nil {
		t.Fatal(err)
	}
	gcNow(t, cat, data)
	gone(t, lb...)
	if left := append(files(t, odir, ""), files(t, blobs, "")...); len(left) != 0 {
		t.Errorf("left after every template went: %v", left)
	}
}

// TestGCImports: an image import (img-*) stays while a template is built on it, a
// sandbox runs on it or a build is running, and goes with its directory and blob after.
// Files newer than the grace period stay whatever names them.
func TestGCImports(t *testing.T) {
	data := t.TempDir()
	cat, err := catalog.Open(filepath.Join(data, "aenv.db"))
	if err != nil {
		t.Fatal(err)
	}
	defer cat.Close()
	ts := cat.Templates()
	blobHex := strings.Repeat("ab", 32)
	blobs := filepath.Join(data, ImagesDir, "layers", "sha256")
	imp := filepath.Join(data, TemplatesDir, "img-0123")
	orphan := filepath.Join(data, TemplatesDir, "img-crashed")
	for _, d := range []string{blobs, filepath.Join(imp, "rootfs"), filepath.Join(orphan, "rootfs")} {
		if err := os.MkdirAll(d, 0o755); err != nil {
			t.Fatal(err)
		}
	}
	if err := os.WriteFile(filepath.Join(blobs, blobHex), []byte("blob"), 0o644); err != nil {
		t.Fatal(err)
	}
	art, _ := json.Marshal(image.Artifact{Kind: image.ArtifactKind, Layers: []image.Layer{{Digest: "sha256:" + blobHex}}})
	must := func(err error) {
		t.Helper()
		if err != nil {
			t.Fatal(err)
		}
	}
	must(ts.Put(catalog.Template{ID: "img-0123", Kind: catalog.KindTemplate, RootFSDir: filepath.Join(imp, "rootfs"), Artifact: art}))
	must(ts.Put(catalog.Template{ID: "built", Kind: catalog.KindTemplate, Artifact: json.RawMessage(`{"base":"img-0123"}`)}))

	var deleted []string
	run := func(o GCOptions) GCResult {
		t.Helper()
		all, err := ts.List("")
		must(err)
		o.DataDir, o.Templates = data, all
		if o.Grace == 0 {
			o.Grace = time.Nanosecond
		}
		o.DeleteImport = func(t catalog.Template) error {
			deleted = append(deleted, t.ID)
			_, err := ts.Delete(t.ID)
			return err
		}
		r, err := GC(context.Background(), o)
		must(err)
		return r
	}
	r := run(GCOptions{})
	if len(r.Imports) != 0 || !slices.Equal(r.Dirs, []string{orphan}) {
		t.Fatalf("with a template on the import: %+v", r)
	}
	must2 := func(_ catalog.Template, err error) { must(err) }
	must2(ts.Delete("built"))
	cases := []struct {
		name string
		o    GCOptions
	}{
		{"build running", GCOptions{KeepImports: true}},
		{"sandbox record names it", GCOptions{Docs: []json.RawMessage{json.RawMessage(`{"templateID":"img-0123"}`)}}},
		{"sandbox runs on its rootfs", GCOptions{InUse: func(d string) bool { return d == filepath.Join(imp, "rootfs") }}},
	}
	for _, c := range cases {
		if r := run(c.o); len(r.Imports) != 0 || len(r.Blobs) != 0 {
			t.Errorf("%s: collected %+v", c.name, r)
		}
	}
	r = run(GCOptions{})
	if !slices.Equal(r.Imports, []string{"img-0123"}) || !slices.Equal(r.Dirs, []string{imp}) || len(r.Blobs) != 1 {
		t.Fatalf("unreferenced import: %+v", r)
	}
	if _, err := os.Stat(imp); !os.IsNotExist(err) {
		t.Errorf("import dir kept: %v", err)
	}

	// A fresh unreferenced layer (a conversion not registered yet) is spared.
	odir := filepath.Join(data, OverlaybdDir)
	must(os.MkdirAll(odir, 0o755))
	must(os.WriteFile(filepath.Join(odir, "k1.zfile"), []byte("layer"), 0o644))
	if r := run(GCOptions{Grace: time.Hour}); len(r.Layers) != 0 {
		t.Errorf("fresh layer collected: %v", r.Layers)
	}
	if r := run(GCOptions{}); len(r.Layers) != 1 {
		t.Errorf("stale layer kept: %+v", r)
	}
}
