package convert

import (
	"archive/tar"
	"bytes"
	"context"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	v1 "github.com/google/go-containerregistry/pkg/v1"
	"github.com/google/go-containerregistry/pkg/v1/empty"
	"github.com/google/go-containerregistry/pkg/v1/layout"
	"github.com/google/go-containerregistry/pkg/v1/mutate"
	"github.com/google/go-containerregistry/pkg/v1/tarball"
	"github.com/google/go-containerregistry/pkg/v1/types"
	"golang.org/x/sys/unix"

	"github.com/aenv-dev/aenv/internal/image"
	"github.com/aenv-dev/aenv/internal/storage/blockdev"
	"github.com/aenv-dev/aenv/internal/storage/stack"
)

func requireRoot(t testing.TB) {
	t.Helper()
	if os.Geteuid() != 0 {
		t.Skip("needs root (FUSE, loop devices, ext4 mounts)")
	}
	for _, p := range []string{"/dev/fuse", "/dev/loop-control"} {
		if _, err := os.Stat(p); err != nil {
			t.Skipf("needs %s", p)
		}
	}
	if _, err := exec.LookPath("mkfs.ext4"); err != nil {
		t.Skip("needs mkfs.ext4 (e2fsprogs)")
	}
}

type ent struct {
	name, link, body string
	typ              byte
	mode             int64
	uid              int
}

func layer(t testing.TB, ents ...ent) v1.Layer {
	t.Helper()
	var buf bytes.Buffer
	tw := tar.NewWriter(&buf)
	for _, e := range ents {
		h := &tar.Header{Name: e.name, Linkname: e.link, Typeflag: e.typ, Mode: e.mode, Uid: e.uid, Gid: e.uid,
			ModTime: time.Unix(1_600_000_000, 0), Size: int64(len(e.body))}
		if h.Typeflag == 0 {
			h.Typeflag = tar.TypeReg
		}
		if h.Mode == 0 {
			h.Mode = 0o755
		}
		if h.Typeflag != tar.TypeReg {
			h.Size = 0
		}
		tw.WriteHeader(h)
		tw.Write([]byte(e.body))
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

func pullLayout(t testing.TB, layers ...v1.Layer) *image.Image {
	t.Helper()
	img, err := mutate.AppendLayers(empty.Image, layers...)
	if err != nil {
		t.Fatal(err)
	}
	cf, _ := img.ConfigFile()
	cf = cf.DeepCopy()
	cf.OS, cf.Architecture = image.HostPlatform().OS, image.HostPlatform().Architecture
	img, _ = mutate.ConfigFile(mutate.MediaType(img, types.OCIManifestSchema1), cf)
	dir := t.TempDir()
	lp, err := layout.Write(dir, empty.Index)
	if err != nil {
		t.Fatal(err)
	}
	if err := lp.AppendImage(img); err != nil {
		t.Fatal(err)
	}
	pulled, err := image.Pull(context.Background(), "oci:"+dir, image.Options{})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { pulled.Close() })
	return pulled
}

// mountRO exposes a converted stack read-only and mounts its ext4.
func mountRO(t *testing.T, res *Result) string {
	t.Helper()
	ctx := context.Background()
	st, err := stack.Open(ctx, res.Manifest(), stack.Options{})
	if err != nil {
		t.Fatal(err)
	}
	dir := t.TempDir()
	fm, err := blockdev.MountFile(ctx, filepath.Join(dir, "fuse"), st, blockdev.MountOptions{ReadOnly: true})
	if err != nil {
		t.Fatal(err)
	}
	loop, err := blockdev.AttachLoop(ctx, fm.Path(), true)
	if err != nil {
		fm.Close()
		t.Fatal(err)
	}
	// The converted filesystem must be consistent, not just readable.
	if out, err := exec.Command("e2fsck", "-fn", loop.Path()).CombinedOutput(); err != nil {
		t.Errorf("e2fsck on the converted stack: %v\n%s", err, out)
	}
	mnt := filepath.Join(dir, "mnt")
	os.Mkdir(mnt, 0o755)
	if err := unix.Mount(loop.Path(), mnt, "ext4", unix.MS_RDONLY, "noload"); err != nil {
		loop.Detach()
		fm.Close()
		t.Fatal(err)
	}
	t.Cleanup(func() {
		unix.Unmount(mnt, 0)
		loop.Detach()
		fm.Close()
		st.Close()
	})
	return mnt
}

func TestConvertLayers(t *testing.T) {
	requireRoot(t)
	ctx := context.Background()
	base := layer(t,
		ent{name: "bin/", typ: tar.TypeDir},
		ent{name: "bin/tool", body: "tool-v1"},
		ent{name: "etc/", typ: tar.TypeDir},
		ent{name: "etc/conf", body: "conf", mode: 0o640, uid: 1000},
		ent{name: "cache/", typ: tar.TypeDir},
		ent{name: "cache/x", body: "x"},
	)
	top := layer(t,
		ent{name: "bin/.wh.tool"},
		ent{name: "cache/.wh..wh..opq"},
		ent{name: "cache/y", body: "y"},
		ent{name: "big", body: strings.Repeat("0123456789abcdef", 64<<10)},
		ent{name: "etc/conf-link", typ: tar.TypeLink, link: "etc/conf"},
		ent{name: "etc/sym", typ: tar.TypeSymlink, link: "/etc/conf"},
	)
	data := t.TempDir()
	o := Options{Store: &image.Store{Dir: filepath.Join(data, "images")}, Dir: filepath.Join(data, "overlaybd"), SizeMB: 64}
	res, err := Convert(ctx, pullLayout(t, base, top), o)
	if err != nil {
		t.Fatal(err)
	}
	if len(res.Layers) != 3 || res.Converted != 3 {
		t.Fatalf("layers %d converted %d", len(res.Layers), res.Converted)
	}
	for _, l := range res.Layers {
		if !strings.HasPrefix(l.Digest, "sha256:") || l.UUID == "" || l.Size == 0 {
			t.Errorf("layer ref %+v", l)
		}
	}
	mnt := mountRO(t, res)
	check := map[string]string{"cache/y": "y", "etc/conf": "conf", "etc/conf-link": "conf",
		"big": strings.Repeat("0123456789abcdef", 64<<10)}
	for p, want := range check {
		if b, err := os.ReadFile(filepath.Join(mnt, p)); err != nil || string(b) != want {
			t.Errorf("%s: %d bytes, %v", p, len(b), err)
		}
	}
	for _, gone := range []string{"bin/tool", "cache/x"} {
		if _, err := os.Lstat(filepath.Join(mnt, gone)); !os.IsNotExist(err) {
			t.Errorf("%s survived its whiteout: %v", gone, err)
		}
	}
	var st unix.Stat_t
	unix.Lstat(filepath.Join(mnt, "etc/conf"), &st)
	if st.Uid != 1000 || st.Mode&0o777 != 0o640 || st.Nlink != 2 {
		t.Errorf("etc/conf uid %d mode %o nlink %d", st.Uid, st.Mode&0o777, st.Nlink)
	}
	if l, _ := os.Readlink(filepath.Join(mnt, "etc/sym")); l != "/etc/conf" {
		t.Errorf("symlink = %q", l)
	}

	// A second image on the same base converts only its own top layer.
	other := layer(t, ent{name: "other", body: "o"})
	res2, err := Convert(ctx, pullLayout(t, base, other), o)
	if err != nil {
		t.Fatal(err)
	}
	if res2.Converted != 1 || res2.Layers[1] != res.Layers[1] {
		t.Errorf("second image converted %d layers; shared base %v vs %v", res2.Converted, res2.Layers[1], res.Layers[1])
	}
	assertNoLeaks(t, o.Dir)
	ents, _ := os.ReadDir(o.Dir)
	for _, e := range ents {
		if strings.HasPrefix(e.Name(), ".work") || strings.HasSuffix(e.Name(), ".tmp") {
			t.Errorf("left behind: %s", e.Name())
		}
	}
}

// TestConvertDiskFull converts a layer larger than the disk: the build
// fails with the filesystem's error and leaves nothing mounted or cached.
func TestConvertDiskFull(t *testing.T) {
	requireRoot(t)
	big := layer(t, ent{name: "huge", body: strings.Repeat("z", 24<<20)})
	data := t.TempDir()
	o := Options{Store: &image.Store{Dir: filepath.Join(data, "images")}, Dir: filepath.Join(data, "overlaybd"), SizeMB: 16}
	_, err := Convert(context.Background(), pullLayout(t, big), o)
	if err == nil || !strings.Contains(err.Error(), "no space") {
		t.Fatalf("err = %v, want no space left", err)
	}
	assertNoLeaks(t, o.Dir)
	ents, _ := os.ReadDir(o.Dir)
	for _, e := range ents {
		if strings.HasPrefix(e.Name(), ".work") || strings.HasSuffix(e.Name(), layerExt) && !strings.Contains(e.Name(), "ext4") {
			t.Errorf("left behind: %s", e.Name())
		}
	}
}

func TestConvertBadLayerLeavesNothing(t *testing.T) {
	requireRoot(t)
	bad := layer(t, ent{name: "../escape", body: "x"})
	data := t.TempDir()
	o := Options{Store: &image.Store{Dir: filepath.Join(data, "images")}, Dir: filepath.Join(data, "overlaybd"), SizeMB: 32}
	_, err := Convert(context.Background(), pullLayout(t, bad), o)
	if err == nil {
		t.Fatal("hostile layer converted")
	}
	assertNoLeaks(t, o.Dir)
	ents, _ := os.ReadDir(o.Dir)
	for _, e := range ents {
		if strings.HasSuffix(e.Name(), layerExt) && !strings.Contains(e.Name(), "ext4") {
			t.Errorf("a layer entered the cache: %s", e.Name())
		}
	}
}

// assertNoLeaks fails when a mount or a loop device still refers to dir.
func assertNoLeaks(t *testing.T, dir string) {
	t.Helper()
	mi, _ := os.ReadFile("/proc/self/mountinfo")
	if strings.Contains(string(mi), dir) {
		t.Errorf("mount left under %s", dir)
	}
	files, _ := filepath.Glob("/sys/block/loop*/loop/backing_file")
	for _, f := range files {
		if b, _ := os.ReadFile(f); strings.Contains(string(b), dir) {
			t.Errorf("loop device left: %s -> %s", f, b)
		}
	}
}
