package image

import (
	"archive/tar"
	"bytes"
	"context"
	"io"
	"log"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/aenv-dev/aenv/internal/image/imagetest"
	"github.com/google/go-containerregistry/pkg/name"
	"github.com/google/go-containerregistry/pkg/registry"
	v1 "github.com/google/go-containerregistry/pkg/v1"
	"github.com/google/go-containerregistry/pkg/v1/empty"
	"github.com/google/go-containerregistry/pkg/v1/mutate"
	"github.com/google/go-containerregistry/pkg/v1/remote"
	"github.com/google/go-containerregistry/pkg/v1/tarball"
	"github.com/google/go-containerregistry/pkg/v1/types"
)

type ent struct {
	name, link string
	typ        byte
	body       string
	mode       int64
	uid, gid   int
}

var epoch = time.Unix(1_600_000_000, 0)

func tarOf(t testing.TB, ents ...ent) []byte {
	t.Helper()
	var buf bytes.Buffer
	tw := tar.NewWriter(&buf)
	for _, e := range ents {
		h := &tar.Header{Name: e.name, Linkname: e.link, Typeflag: e.typ, Mode: e.mode, Uid: e.uid, Gid: e.gid, ModTime: epoch}
		if h.Typeflag == 0 {
			h.Typeflag = tar.TypeReg
		}
		if h.Mode == 0 {
			h.Mode = 0o644
			if h.Typeflag == tar.TypeDir {
				h.Mode = 0o755
			}
		}
		if h.Typeflag == tar.TypeReg {
			h.Size = int64(len(e.body))
		}
		if err := tw.WriteHeader(h); err != nil {
			t.Fatal(err)
		}
		if h.Typeflag == tar.TypeReg {
			tw.Write([]byte(e.body))
		}
	}
	if err := tw.Close(); err != nil {
		t.Fatal(err)
	}
	return buf.Bytes()
}

func layerOf(t testing.TB, tr []byte) v1.Layer {
	t.Helper()
	l, err := tarball.LayerFromOpener(func() (io.ReadCloser, error) { return io.NopCloser(bytes.NewReader(tr)), nil },
		tarball.WithMediaType(types.OCILayer), tarball.WithCompressedCaching)
	if err != nil {
		t.Fatal(err)
	}
	return l
}

// testConfig is the image configuration of the test images.
var testConfig = v1.Config{
	Env:          []string{"PATH=/usr/local/bin:/usr/bin:/bin", "GREETING=hello world"},
	WorkingDir:   "/srv",
	User:         "root",
	Entrypoint:   []string{"/bin/server"},
	Cmd:          []string{"--port", "8080"},
	ExposedPorts: map[string]struct{}{"8080/tcp": {}},
	Labels:       map[string]string{"org.example": "yes"},
}

// Layers of the test image: a base, then a layer with a whiteout, an opaque
// directory, a hard link and a symlink.
func baseLayer(t testing.TB) []byte {
	return tarOf(t,
		ent{name: "bin/", typ: tar.TypeDir},
		ent{name: "bin/server", body: "#!/bin/sh\necho server\n", mode: 0o755},
		ent{name: "bin/sh", typ: tar.TypeSymlink, link: "/bin/server"},
		ent{name: "etc/", typ: tar.TypeDir},
		ent{name: "etc/passwd", body: "root:x:0:0:root:/root:/bin/sh\n"},
		ent{name: "etc/group", body: "root:x:0:\n"},
		ent{name: "srv/", typ: tar.TypeDir},
		ent{name: "srv/old", body: "old"},
		ent{name: "var/cache/", typ: tar.TypeDir},
		ent{name: "var/cache/a", body: "a"},
		ent{name: "var/cache/b", body: "b"},
	)
}

func topLayer(t testing.TB) []byte {
	return tarOf(t,
		ent{name: "srv/.wh.old"},
		ent{name: "var/cache/.wh..wh..opq"},
		ent{name: "var/cache/c", body: "c"},
		ent{name: "srv/app", body: "app", mode: 0o750, uid: 33, gid: 33},
		ent{name: "srv/app-link", typ: tar.TypeLink, link: "srv/app"},
		ent{name: "srv/current", typ: tar.TypeSymlink, link: "/srv/app"},
	)
}

// wantTree is the rootfs of the test image after BuildTemplate.
var wantTree = []string{
	".aenv drwxr-xr-x 0:0",
	".aenv/envd -rwxr-xr-x 0:0 ",
	"bin drwxr-xr-x 0:0",
	"bin/server -rwxr-xr-x 0:0 #!/bin/sh\necho server\n",
	"bin/sh Lrwxrwxrwx 0:0 -> /bin/server",
	"dev drwxr-xr-x 0:0",
	"etc drwxr-xr-x 0:0",
	"etc/group -rw-r--r-- 0:0 root:x:0:\nuser:x:1000:\n",
	"etc/hostname -rw-r--r-- 0:0 ",
	"etc/hosts -rw-r--r-- 0:0 ",
	"etc/passwd -rw-r--r-- 0:0 root:x:0:0:root:/root:/bin/sh\nuser:x:1000:1000::/home/user:/bin/sh\n",
	"etc/resolv.conf -rw-r--r-- 0:0 ",
	"home drwxr-xr-x 0:0",
	"home/user drwxr-xr-x 1000:1000",
	"proc dr-xr-xr-x 0:0",
	"run drwxr-xr-x 0:0",
	"srv drwxr-xr-x 0:0",
	"srv/app -rwxr-x--- 33:33 app",
	"srv/app-link -rwxr-x--- 33:33 app",
	"srv/current Lrwxrwxrwx 0:0 -> /srv/app",
	"sys dr-xr-xr-x 0:0",
	"tmp dtrwxrwxrwx 0:0",
	"var drwxr-xr-x 0:0",
	"var/cache drwxr-xr-x 0:0",
	"var/cache/c -rw-r--r-- 0:0 c",
}

func testImage(t testing.TB, arch string) v1.Image {
	t.Helper()
	img, err := mutate.AppendLayers(empty.Image, layerOf(t, baseLayer(t)), layerOf(t, topLayer(t)))
	if err != nil {
		t.Fatal(err)
	}
	return withConfig(t, img, arch)
}

func withConfig(t testing.TB, img v1.Image, arch string) v1.Image {
	t.Helper()
	img = mutate.MediaType(img, types.OCIManifestSchema1)
	img = mutate.ConfigMediaType(img, types.OCIConfigJSON)
	cf, err := img.ConfigFile()
	if err != nil {
		t.Fatal(err)
	}
	cf = cf.DeepCopy()
	cf.OS, cf.Architecture, cf.Config = "linux", arch, testConfig
	img, err = mutate.ConfigFile(img, cf)
	if err != nil {
		t.Fatal(err)
	}
	return img
}

// serveRegistry starts an in-process registry on loopback; wrap may
// intercept requests. It returns "127.0.0.1:PORT".
func serveRegistry(t testing.TB, wrap func(http.Handler) http.Handler) string {
	t.Helper()
	var h http.Handler = registry.New(registry.Logger(nopLogger()))
	if wrap != nil {
		h = wrap(h)
	}
	srv := httptest.NewServer(h)
	t.Cleanup(srv.Close)
	return strings.TrimPrefix(srv.URL, "http://")
}

func push(t testing.TB, ref string, img v1.Image) {
	t.Helper()
	r, err := name.ParseReference(ref)
	if err != nil {
		t.Fatal(err)
	}
	if err := remote.Write(r, img); err != nil {
		t.Fatal(err)
	}
}

// tree lists a directory as sorted "path mode uid:gid [content | -> target]" lines.
func tree(t testing.TB, root string) []string {
	t.Helper()
	return imagetest.Tree(t, root, true)
}

func requireRoot(t testing.TB) {
	t.Helper()
	if os.Geteuid() != 0 {
		t.Skip("needs root: layers carry ownership")
	}
}

func build(t testing.TB, ref string, o Options, store *Store) (*Image, *Built, error) {
	t.Helper()
	ctx := context.Background()
	img, err := Pull(ctx, ref, o)
	if err != nil {
		return nil, nil, err
	}
	t.Cleanup(func() { img.Close() })
	b, err := BuildTemplate(ctx, img, filepath.Join(t.TempDir(), "tpl"), BuildOptions{Store: store})
	return img, b, err
}

func nopLogger() *log.Logger { return log.New(io.Discard, "", 0) }
