package image

import (
	"archive/tar"
	"bytes"
	"context"
	"encoding/base64"
	"errors"
	"io"
	"net/http"
	"os"
	"path/filepath"
	"runtime"
	"strings"
	"sync/atomic"
	"testing"

	"github.com/google/go-containerregistry/pkg/name"
	v1 "github.com/google/go-containerregistry/pkg/v1"
	"github.com/google/go-containerregistry/pkg/v1/empty"
	"github.com/google/go-containerregistry/pkg/v1/layout"
	"github.com/google/go-containerregistry/pkg/v1/mutate"
	"github.com/google/go-containerregistry/pkg/v1/remote"
	"github.com/google/go-containerregistry/pkg/v1/tarball"
	"github.com/google/go-containerregistry/pkg/v1/types"

	"github.com/aenv-dev/aenv/internal/image/unpack"
)

func TestParseReference(t *testing.T) {
	dir := t.TempDir()
	withColon := filepath.Join(dir, "a:b")
	os.Mkdir(withColon, 0o755)
	cases := []struct {
		in   string
		want Source
		err  bool
	}{
		{in: "ubuntu:22.04", want: Source{Transport: Registry, Ref: "ubuntu:22.04"}},
		{in: "docker://127.0.0.1:5000/x/y@sha256:abc", want: Source{Transport: Registry, Ref: "127.0.0.1:5000/x/y@sha256:abc"}},
		{in: "oci:" + dir, want: Source{Transport: OCILayout, Path: dir}},
		{in: "oci:" + dir + ":v1", want: Source{Transport: OCILayout, Path: dir, Ref: "v1"}},
		{in: "oci:" + withColon + ":v2", want: Source{Transport: OCILayout, Path: withColon, Ref: "v2"}},
		{in: "oci:/missing/dir:tag", want: Source{Transport: OCILayout, Path: "/missing/dir", Ref: "tag"}},
		{in: "oci-archive:/x.tar", want: Source{Transport: OCIArchive, Path: "/x.tar"}},
		{in: "docker-archive:/x.tar:repo/name:tag", want: Source{Transport: DockerArchive, Path: "/x.tar", Ref: "repo/name:tag"}},
		{in: "", err: true},
		{in: "oci:", err: true},
		{in: "bad ref", err: true},
	}
	for _, c := range cases {
		got, err := ParseReference(c.in)
		if (err != nil) != c.err || got != c.want {
			t.Errorf("ParseReference(%q) = %+v, %v; want %+v (err %v)", c.in, got, err, c.want, c.err)
		}
	}
}

func TestInsecure(t *testing.T) {
	for host, want := range map[string]bool{
		"127.0.0.1:5000": true, "127.5.5.5": true, "[::1]:80": true, "localhost:5000": true,
		"reg.localhost": true, "10.0.0.1:5000": false, "registry.example:5000": false, "my.insecure:5000": true,
	} {
		if got := insecure(host, []string{"my.insecure:5000"}); got != want {
			t.Errorf("insecure(%q) = %v", host, got)
		}
	}
}

// TestPullSources pulls the same image from every transport and checks the
// resulting root filesystem entry by entry, byte for byte.
func TestPullSources(t *testing.T) {
	requireRoot(t)
	img := testImage(t, runtime.GOARCH)
	host := serveRegistry(t, nil)
	push(t, host+"/test/app:v1", img)

	layoutDir := filepath.Join(t.TempDir(), "layout")
	lp, err := layout.Write(layoutDir, empty.Index)
	if err != nil {
		t.Fatal(err)
	}
	if err := lp.AppendImage(img, layout.WithAnnotations(map[string]string{refNameAnnotation: "v1"})); err != nil {
		t.Fatal(err)
	}
	ociArchive := filepath.Join(t.TempDir(), "oci.tar")
	tarDir(t, layoutDir, ociArchive)
	dockerArchive := filepath.Join(t.TempDir(), "docker.tar")
	tag, _ := name.NewTag("test/app:v1")
	if err := tarball.WriteToFile(dockerArchive, tag, img); err != nil {
		t.Fatal(err)
	}
	wantDigest, _ := img.Digest()
	for _, ref := range []string{
		host + "/test/app:v1",
		"oci:" + layoutDir + ":v1",
		"oci:" + layoutDir,
		"oci-archive:" + ociArchive + ":v1",
		"docker-archive:" + dockerArchive,
	} {
		t.Run(strings.SplitN(ref, ":", 2)[0], func(t *testing.T) {
			store := &Store{Dir: t.TempDir()}
			pulled, b, err := build(t, ref, Options{}, store)
			if err != nil {
				t.Fatal(err)
			}
			if !strings.HasPrefix(ref, "docker-archive") && pulled.Digest != wantDigest.String() {
				t.Errorf("digest = %s, want %s", pulled.Digest, wantDigest)
			}
			got := tree(t, b.RootFS)
			if strings.Join(got, "\n") != strings.Join(wantTree, "\n") {
				t.Errorf("rootfs:\n%s\nwant:\n%s", strings.Join(got, "\n"), strings.Join(wantTree, "\n"))
			}
			c := b.Image.Config
			if c.WorkingDir != "/srv" || strings.Join(c.Entrypoint, " ") != "/bin/server" ||
				strings.Join(c.ExposedPorts, ",") != "8080/tcp" || c.Labels["org.example"] != "yes" || len(c.Env) != 2 {
				t.Errorf("config = %+v", c)
			}
			if b.UserUID != 1000 || len(b.Image.Layers) != 2 {
				t.Errorf("uid %d, layers %d", b.UserUID, len(b.Image.Layers))
			}
			back, err := LoadBuilt(b.Dir)
			if err != nil || back.Image.Digest != pulled.Digest {
				t.Errorf("LoadBuilt: %v, %+v", err, back)
			}
			if ents, _ := os.ReadDir(filepath.Dir(b.Dir)); len(ents) != 1 {
				t.Errorf("template parent holds %d entries (temp dirs left?)", len(ents))
			}
		})
	}
}

func tarDir(t *testing.T, dir, out string) {
	t.Helper()
	f, err := os.Create(out)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	tw := tar.NewWriter(f)
	if err := tw.AddFS(os.DirFS(dir)); err != nil {
		t.Fatal(err)
	}
	if err := tw.Close(); err != nil {
		t.Fatal(err)
	}
}

func TestPullIndexPicksHostPlatform(t *testing.T) {
	other := "arm64"
	if runtime.GOARCH == "arm64" {
		other = "amd64"
	}
	mine := testImage(t, runtime.GOARCH)
	theirs, err := mutate.AppendLayers(empty.Image, layerOf(t, tarOf(t, ent{name: "wrong", body: "arch"})))
	if err != nil {
		t.Fatal(err)
	}
	theirs = withConfig(t, theirs, other)
	idx := mutate.AppendManifests(mutate.IndexMediaType(empty.Index, types.OCIImageIndex),
		mutate.IndexAddendum{Add: theirs, Descriptor: v1.Descriptor{Platform: &v1.Platform{OS: "linux", Architecture: other}}},
		mutate.IndexAddendum{Add: mine, Descriptor: v1.Descriptor{Platform: &v1.Platform{OS: "linux", Architecture: runtime.GOARCH}}},
	)
	host := serveRegistry(t, nil)
	r, _ := name.ParseReference(host + "/multi:latest")
	if err := remote.WriteIndex(r, idx); err != nil {
		t.Fatal(err)
	}
	layoutDir := t.TempDir()
	lp, _ := layout.Write(layoutDir, empty.Index)
	if err := lp.AppendIndex(idx, layout.WithAnnotations(map[string]string{refNameAnnotation: "latest"})); err != nil {
		t.Fatal(err)
	}
	want, _ := mine.Digest()
	for _, ref := range []string{host + "/multi:latest", "oci:" + layoutDir + ":latest"} {
		img, err := Pull(context.Background(), ref, Options{})
		if err != nil {
			t.Fatalf("%s: %v", ref, err)
		}
		if img.Digest != want.String() || img.Config.Architecture != runtime.GOARCH {
			t.Errorf("%s: picked %s (%s), want %s", ref, img.Digest, img.Config.Architecture, want)
		}
		img.Close()
		_, err = Pull(context.Background(), ref, Options{Platform: &v1.Platform{OS: "linux", Architecture: "s390x"}})
		if !errors.Is(err, ErrPlatform) {
			t.Errorf("%s for s390x: err = %v, want ErrPlatform", ref, err)
		}
	}
	// A single-platform image for another architecture is refused too.
	push(t, host+"/theirs:1", theirs)
	if _, err := Pull(context.Background(), host+"/theirs:1", Options{}); !errors.Is(err, ErrPlatform) {
		t.Errorf("foreign single-arch image: err = %v, want ErrPlatform", err)
	}
}

// corrupting flips one byte of every blob response for digest.
func corrupting(digest string) func(http.Handler) http.Handler {
	return func(next http.Handler) http.Handler {
		return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			if r.Method != http.MethodGet || !strings.HasSuffix(r.URL.Path, "/blobs/"+digest) {
				next.ServeHTTP(w, r)
				return
			}
			rec := &bufferWriter{header: http.Header{}}
			next.ServeHTTP(rec, r)
			body := rec.buf.Bytes()
			if len(body) > 20 {
				body[len(body)/2] ^= 0xff
			}
			for k, v := range rec.header {
				w.Header()[k] = v
			}
			w.WriteHeader(rec.code)
			w.Write(body)
		})
	}
}

type bufferWriter struct {
	header http.Header
	buf    bytes.Buffer
	code   int
}

func (b *bufferWriter) Header() http.Header { return b.header }
func (b *bufferWriter) Write(p []byte) (int, error) {
	if b.code == 0 {
		b.code = 200
	}
	return b.buf.Write(p)
}
func (b *bufferWriter) WriteHeader(c int) { b.code = c }

func TestCorruptBlobRejected(t *testing.T) {
	img := testImage(t, runtime.GOARCH)
	layers, _ := img.Layers()
	bad, _ := layers[1].Digest()

	host := serveRegistry(t, corrupting(bad.String()))
	push(t, host+"/c:1", img)

	layoutDir := t.TempDir()
	lp, _ := layout.Write(layoutDir, empty.Index)
	lp.AppendImage(img)
	blob := filepath.Join(layoutDir, "blobs", "sha256", bad.Hex)
	b, _ := os.ReadFile(blob)
	b[len(b)/2] ^= 0xff
	os.WriteFile(blob, b, 0o644)

	for _, ref := range []string{host + "/c:1", "oci:" + layoutDir} {
		store := &Store{Dir: t.TempDir()}
		_, _, err := build(t, ref, Options{}, store)
		if err == nil {
			t.Fatalf("%s: corrupt layer accepted", ref)
		}
		if !errors.Is(err, ErrDigestMismatch) {
			t.Errorf("%s: err = %v, want ErrDigestMismatch", ref, err)
		}
		if store.Has(bad.String()) {
			t.Errorf("%s: corrupt blob was cached", ref)
		}
		t.Logf("%s: %v", ref, err)
	}
}

// TestCorruptCachedLayer damages a blob after it was cached with a valid
// digest; the diff id check on unpack catches it.
func TestCorruptCachedLayer(t *testing.T) {
	requireRoot(t)
	ctx := context.Background()
	img := testImage(t, runtime.GOARCH)
	layoutDir := t.TempDir()
	lp, _ := layout.Write(layoutDir, empty.Index)
	lp.AppendImage(img)
	pulled, err := Pull(ctx, "oci:"+layoutDir, Options{})
	if err != nil {
		t.Fatal(err)
	}
	store := &Store{Dir: t.TempDir()}
	if err := store.Fetch(ctx, pulled, nil); err != nil {
		t.Fatal(err)
	}
	l := pulled.Layers[0]
	// Replace the cached blob by a valid gzip stream of different content.
	p, _ := store.blobPath(l.Digest)
	other, _ := layerOf(t, tarOf(t, ent{name: "evil", body: "x"})).Compressed()
	raw, _ := io.ReadAll(other)
	os.WriteFile(p, raw, 0o644)
	dir := filepath.Join(t.TempDir(), "tpl")
	_, err = BuildTemplate(ctx, pulled, dir, BuildOptions{Store: store})
	if !errors.Is(err, ErrDigestMismatch) {
		t.Fatalf("err = %v, want ErrDigestMismatch", err)
	}
	if _, err := os.Stat(dir); !os.IsNotExist(err) {
		t.Errorf("template dir exists after a failed build")
	}
}

func TestRegistryAuth(t *testing.T) {
	const user, pass = "alice", "s3cret"
	host := serveRegistry(t, func(next http.Handler) http.Handler {
		return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			if u, p, ok := r.BasicAuth(); !ok || u != user || p != pass {
				w.Header().Set("WWW-Authenticate", `Basic realm="test"`)
				http.Error(w, "unauthorized", http.StatusUnauthorized)
				return
			}
			next.ServeHTTP(w, r)
		})
	})
	img := testImage(t, runtime.GOARCH)
	r, _ := name.ParseReference(host + "/private:1")
	if err := remote.Write(r, img, remote.WithAuth(basic(user, pass))); err != nil {
		t.Fatal(err)
	}
	cfg := filepath.Join(t.TempDir(), "config.json")
	auth := base64.StdEncoding.EncodeToString([]byte(user + ":" + pass))
	os.WriteFile(cfg, []byte(`{"auths":{"`+host+`":{"auth":"`+auth+`"}}}`), 0o600)
	wrong := filepath.Join(t.TempDir(), "config.json")
	bad := base64.StdEncoding.EncodeToString([]byte(user + ":nope"))
	os.WriteFile(wrong, []byte(`{"auths":{"`+host+`":{"auth":"`+bad+`"}}}`), 0o600)

	ctx := context.Background()
	if _, err := Pull(ctx, host+"/private:1", Options{DockerConfig: wrong}); !errors.Is(err, ErrUnauthorized) {
		t.Errorf("wrong credentials: err = %v, want ErrUnauthorized", err)
	}
	pulled, err := Pull(ctx, host+"/private:1", Options{DockerConfig: cfg})
	if err != nil {
		t.Fatal(err)
	}
	if err := (&Store{Dir: t.TempDir()}).Fetch(ctx, pulled, nil); err != nil {
		t.Fatalf("fetch with credentials: %v", err)
	}
}

func TestPullErrors(t *testing.T) {
	host := serveRegistry(t, nil)
	ctx := context.Background()
	// A manifest whose layer has a media type we cannot unpack.
	odd, err := mutate.Append(empty.Image, mutate.Addendum{Layer: layerOf(t, tarOf(t, ent{name: "x", body: "x"})),
		MediaType: "application/vnd.example.weird"})
	if err != nil {
		t.Fatal(err)
	}
	push(t, host+"/odd:1", withConfig(t, odd, runtime.GOARCH))
	cases := []struct {
		ref  string
		want error
	}{
		{host + "/nope:latest", ErrNotFound},
		{host + "/odd:1", ErrUnsupportedMedia},
		{"oci:" + filepath.Join(t.TempDir(), "missing"), ErrNotFound},
		{"docker-archive:/nonexistent.tar", ErrNotFound},
		{"127.0.0.1:1/down:1", nil},
		{"UPPER/case", ErrBadReference},
	}
	for _, c := range cases {
		_, err := Pull(ctx, c.ref, Options{})
		if err == nil || c.want != nil && !errors.Is(err, c.want) {
			t.Errorf("Pull(%s) = %v, want %v", c.ref, err, c.want)
		}
	}
}

func TestSharedBaseFetchedOnce(t *testing.T) {
	ctx := context.Background()
	base := layerOf(t, baseLayer(t))
	a, _ := mutate.AppendLayers(empty.Image, base, layerOf(t, tarOf(t, ent{name: "a", body: "a"})))
	b, _ := mutate.AppendLayers(empty.Image, base, layerOf(t, tarOf(t, ent{name: "b", body: "b"})))
	var baseFetches atomic.Int32
	baseDigest, _ := base.Digest()
	host := serveRegistry(t, func(next http.Handler) http.Handler {
		return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			if r.Method == http.MethodGet && strings.HasSuffix(r.URL.Path, baseDigest.String()) {
				baseFetches.Add(1)
			}
			next.ServeHTTP(w, r)
		})
	})
	push(t, host+"/a:1", withConfig(t, a, runtime.GOARCH))
	push(t, host+"/b:1", withConfig(t, b, runtime.GOARCH))
	store := &Store{Dir: t.TempDir()}
	var cached []bool
	for _, ref := range []string{host + "/a:1", host + "/b:1"} {
		img, err := Pull(ctx, ref, Options{})
		if err != nil {
			t.Fatal(err)
		}
		err = store.Fetch(ctx, img, func(p Progress) {
			if p.Final && p.Layer == 1 {
				cached = append(cached, p.Cached)
			}
		})
		if err != nil {
			t.Fatal(err)
		}
	}
	if baseFetches.Load() != 1 || len(cached) != 2 || cached[0] || !cached[1] {
		t.Errorf("base fetched %d times; cached flags %v", baseFetches.Load(), cached)
	}
}

func basic(u, p string) *basicAuth { return &basicAuth{u, p} }

// TestHostileLayerRejected: a layer that tries to leave the root fails the
// build with ErrUnsafePath and leaves no template directory.
func TestHostileLayerRejected(t *testing.T) {
	for name, ents := range map[string][]ent{
		"dotdot":       {{name: "../../evil", body: "x"}},
		"absolute":     {{name: "/etc/evil", body: "x"}},
		"hardlink-out": {{name: "h", typ: tar.TypeLink, link: "../../../etc/passwd"}},
		"whiteout-up":  {{name: "a/.wh..."}},
	} {
		t.Run(name, func(t *testing.T) {
			img, err := mutate.AppendLayers(empty.Image, layerOf(t, tarOf(t, ents...)))
			if err != nil {
				t.Fatal(err)
			}
			dir := t.TempDir()
			lp, _ := layout.Write(dir, empty.Index)
			lp.AppendImage(withConfig(t, img, runtime.GOARCH))
			_, b, err := build(t, "oci:"+dir, Options{}, &Store{Dir: t.TempDir()})
			if !errors.Is(err, unpack.ErrUnsafePath) {
				t.Fatalf("err = %v, want ErrUnsafePath", err)
			}
			if b != nil {
				t.Errorf("built %+v", b)
			}
		})
	}
}
