package convert

import (
	"archive/tar"
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"testing"

	"github.com/aenv-dev/aenv/internal/image"
)

// TestConvertPrepare: with Options.User a converted image ends with a layer of its own
// that holds what the directory path's PrepareRootFS adds (the account `user`, its home
// owned by it, the envd mount point), byte for byte; the image's layers are unchanged
// and shared with a conversion without it.
func TestConvertPrepare(t *testing.T) {
	requireRoot(t)
	ctx := context.Background()
	base := layer(t,
		ent{name: "usr/", typ: tar.TypeDir}, ent{name: "usr/bin/", typ: tar.TypeDir},
		ent{name: "usr/bin/dash", body: "#!"}, ent{name: "usr/bin/bash", body: "#!"},
		ent{name: "usr/bin/sh", typ: tar.TypeSymlink, link: "dash"},
		ent{name: "bin", typ: tar.TypeSymlink, link: "usr/bin"},
		ent{name: "etc/", typ: tar.TypeDir},
		ent{name: "etc/passwd", body: "root:x:0:0:root:/root:/bin/bash\nubuntu:x:1000:1000::/home/ubuntu:/bin/bash\n", mode: 0o644},
		ent{name: "etc/group", body: "root:x:0:\nubuntu:x:1000:\n", mode: 0o644},
		ent{name: "etc/shadow", body: "root:*:19000:0:99999:7:::\n", mode: 0o640})
	img := pullLayout(t, base)
	data := t.TempDir()
	store := &image.Store{Dir: filepath.Join(data, "images")}
	o := Options{Store: store, Dir: filepath.Join(data, "overlaybd"), SizeMB: 32}
	plain, err := Convert(ctx, img, o)
	if err != nil {
		t.Fatal(err)
	}
	o.User = image.DefaultUser
	res, err := Convert(ctx, img, o)
	if err != nil {
		t.Fatal(err)
	}
	if len(res.Layers) != len(plain.Layers)+1 || res.Converted != 1 {
		t.Fatalf("layers %d (converted now %d), want %d + 1 made now", len(res.Layers), res.Converted, len(plain.Layers))
	}
	for i, l := range plain.Layers {
		if res.Layers[i].Digest != l.Digest {
			t.Errorf("image layer %d changed", i)
		}
	}
	built, err := image.BuildTemplate(ctx, img, filepath.Join(data, "tpl"), image.BuildOptions{Store: store})
	if err != nil {
		t.Fatal(err)
	}
	mnt := mountRO(t, res)
	for _, p := range []string{"etc/passwd", "etc/group", "etc/shadow", "home/user", image.EnvdMountpoint, "proc", "tmp"} {
		want, got := describeFile(t, filepath.Join(built.RootFS, p)), describeFile(t, filepath.Join(mnt, p))
		if got != want {
			t.Errorf("/%s: converted %s, directory %s", p, got, want)
		}
	}
	if b, _ := os.ReadFile(filepath.Join(mnt, "etc/passwd")); !strings.Contains(string(b), "\nuser:x:1001:1001::/home/user:/bin/bash\n") {
		t.Errorf("converted /etc/passwd:\n%s", b)
	}
}

// TestConvertPrepareRefuses: an image without /bin/sh is refused with
// image.ErrUnusableImage, leaves nothing mounted, and no prepared layer enters the cache.
func TestConvertPrepareRefuses(t *testing.T) {
	requireRoot(t)
	img := pullLayout(t, layer(t, ent{name: "etc/passwd", body: "root:x:0:0::/root:/bin/sh\n", mode: 0o644}))
	data := t.TempDir()
	o := Options{Store: &image.Store{Dir: filepath.Join(data, "images")}, Dir: filepath.Join(data, "overlaybd"), SizeMB: 32,
		User: image.DefaultUser}
	_, err := Convert(context.Background(), img, o)
	if !errors.Is(err, image.ErrUnusableImage) || !strings.Contains(err.Error(), "/bin/sh") {
		t.Fatalf("err = %v, want ErrUnusableImage naming /bin/sh", err)
	}
	assertNoLeaks(t, o.Dir)
	layers, _ := filepath.Glob(filepath.Join(o.Dir, "*"+layerExt))
	if len(layers) != 2 {
		t.Errorf("cache holds %v, want the base and the image layer only", layers)
	}
}

func describeFile(t *testing.T, p string) string {
	t.Helper()
	fi, err := os.Lstat(p)
	if err != nil {
		return err.Error()
	}
	st := fi.Sys().(*syscall.Stat_t)
	s := fmt.Sprintf("%s %d:%d", fi.Mode(), st.Uid, st.Gid)
	if fi.Mode().IsRegular() {
		b, _ := os.ReadFile(p)
		s += " " + string(b)
	}
	return s
}
