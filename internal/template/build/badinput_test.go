package build

import (
	"archive/tar"
	"bytes"
	"compress/gzip"
	"context"
	"io"
	"log"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/google/go-containerregistry/pkg/authn"
	"github.com/google/go-containerregistry/pkg/name"
	"github.com/google/go-containerregistry/pkg/registry"
	v1 "github.com/google/go-containerregistry/pkg/v1"
	"github.com/google/go-containerregistry/pkg/v1/empty"
	"github.com/google/go-containerregistry/pkg/v1/mutate"
	"github.com/google/go-containerregistry/pkg/v1/remote"
	"github.com/google/go-containerregistry/pkg/v1/tarball"
	"github.com/google/go-containerregistry/pkg/v1/types"

	"github.com/aenv-dev/aenv/internal/catalog"
	"github.com/aenv-dev/aenv/internal/image"
	"github.com/aenv-dev/aenv/internal/sandbox"
)

// hdr is one entry of a test layer.
type hdr struct {
	name, link, body string
	typ              byte
	major, minor     int64
	mode             int64 // default 0o644 (0o755 for directories)
}

func layerTar(t *testing.T, ents ...hdr) []byte {
	t.Helper()
	var buf bytes.Buffer
	tw := tar.NewWriter(&buf)
	for _, e := range ents {
		h := &tar.Header{Name: e.name, Linkname: e.link, Typeflag: e.typ, Mode: 0o644, Size: int64(len(e.body)),
			Devmajor: e.major, Devminor: e.minor, ModTime: time.Unix(1_600_000_000, 0)}
		switch e.typ {
		case 0:
			h.Typeflag = tar.TypeReg
		case tar.TypeDir:
			h.Mode = 0o755
		}
		if h.Typeflag != tar.TypeReg {
			h.Size = 0
		}
		if e.mode != 0 {
			h.Mode = e.mode
		}
		if err := tw.WriteHeader(h); err != nil {
			t.Fatal(err)
		}
		if h.Size > 0 {
			tw.Write([]byte(e.body))
		}
	}
	if err := tw.Close(); err != nil {
		t.Fatal(err)
	}
	return buf.Bytes()
}

// layerOf makes a gzipped image layer of an uncompressed tar.
func layerOf(t *testing.T, b []byte, mt types.MediaType) v1.Layer {
	t.Helper()
	l, err := tarball.LayerFromOpener(func() (io.ReadCloser, error) { return io.NopCloser(bytes.NewReader(b)), nil },
		tarball.WithMediaType(mt))
	if err != nil {
		t.Fatal(err)
	}
	return l
}

// imageOf stacks layers into an image for this host, with a PATH.
func imageOf(t *testing.T, layers ...v1.Layer) v1.Image {
	t.Helper()
	var adds []mutate.Addendum
	for _, l := range layers {
		mt, _ := l.MediaType()
		adds = append(adds, mutate.Addendum{Layer: l, MediaType: mt})
	}
	img, err := mutate.Append(mutate.MediaType(empty.Image, types.OCIManifestSchema1), adds...)
	if err != nil {
		t.Fatal(err)
	}
	cf, err := img.ConfigFile()
	if err != nil {
		t.Fatal(err)
	}
	cf = cf.DeepCopy()
	cf.OS, cf.Architecture = "linux", image.HostPlatform().Architecture
	cf.Config.Env = []string{"PATH=/usr/local/bin:/usr/bin:/bin"}
	if img, err = mutate.ConfigFile(img, cf); err != nil {
		t.Fatal(err)
	}
	return img
}

// testRegistry is an in-process registry on loopback (plain http, as Docker does for
// loopback) whose answers the test can spoil per blob digest.
type testRegistry struct {
	host   string
	spoil  map[string]func(blob []byte) []byte // layer digest → what to serve instead
	blobs  map[string][]byte
	user   string
	pass   string
	secret string // repository that needs user/pass
}

func newTestRegistry(t *testing.T) *testRegistry {
	t.Helper()
	r := &testRegistry{spoil: map[string]func([]byte) []byte{}, blobs: map[string][]byte{}}
	reg := registry.New(registry.Logger(log.New(io.Discard, "", 0)))
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, req *http.Request) {
		if r.secret != "" && strings.HasPrefix(req.URL.Path, "/v2/"+r.secret+"/") {
			if u, p, ok := req.BasicAuth(); !ok || u != r.user || p != r.pass {
				w.Header().Set("WWW-Authenticate", `Basic realm="test"`)
				http.Error(w, "unauthorized", http.StatusUnauthorized)
				return
			}
		}
		if req.Method == http.MethodGet {
			for d, f := range r.spoil {
				if strings.HasSuffix(req.URL.Path, "/blobs/"+d) {
					w.Write(f(r.blobs[d]))
					return
				}
			}
		}
		reg.ServeHTTP(w, req)
	}))
	t.Cleanup(srv.Close)
	r.host = strings.TrimPrefix(srv.URL, "http://")
	return r
}

// push stores img as repo:tag and remembers its layers' blobs.
func (r *testRegistry) push(t *testing.T, repoTag string, img v1.Image) string {
	t.Helper()
	ref, err := name.ParseReference(r.host + "/" + repoTag)
	if err != nil {
		t.Fatal(err)
	}
	if err := remote.Write(ref, img, remote.WithAuth(&authn.Basic{Username: r.user, Password: r.pass})); err != nil {
		t.Fatal(err)
	}
	ls, _ := img.Layers()
	for _, l := range ls {
		d, _ := l.Digest()
		rc, _ := l.Compressed()
		b, _ := io.ReadAll(rc)
		rc.Close()
		r.blobs[d.String()] = b
	}
	return ref.String()
}

func topDigest(t *testing.T, img v1.Image) string {
	t.Helper()
	ls, err := img.Layers()
	if err != nil {
		t.Fatal(err)
	}
	d, err := ls[len(ls)-1].Digest()
	if err != nil {
		t.Fatal(err)
	}
	return d.String()
}

// noLeaks checks that nothing of failed builds is left on the node: sandboxes, image
// imports half made or registered without their files, mounts or loop devices under the
// data directory.
func (n *realNode) noLeaks(t *testing.T) {
	t.Helper()
	n.noSandboxes(t)
	tpls, err := n.cat.Templates().List(catalog.KindTemplate)
	if err != nil {
		t.Fatal(err)
	}
	registered := map[string]bool{}
	for _, tp := range tpls {
		registered[tp.ID] = true
	}
	ents, _ := os.ReadDir(filepath.Join(n.data, "templates"))
	for _, e := range ents {
		if strings.HasPrefix(e.Name(), ".") || !registered[e.Name()] {
			t.Errorf("templates/%s is on disk but not in the catalog", e.Name())
		}
	}
	filepath.WalkDir(filepath.Join(n.data, "images"), func(p string, d os.DirEntry, err error) error {
		if err == nil && strings.HasPrefix(d.Name(), ".tmp-") {
			t.Errorf("partial download left: %s", p)
		}
		return nil
	})
	// The backend keeps warm roots of templates it created sandboxes from: those may
	// stay, on templates that are still there; anything else is a leak.
	warm := filepath.Join(n.data, "oci", "sandboxes", "warm.")
	mounts, _ := os.ReadFile("/proc/self/mountinfo")
	for _, l := range strings.Split(string(mounts), "\n") {
		if !strings.Contains(l, n.data) {
			continue
		}
		if f := strings.Fields(l); len(f) > 4 && f[4] == filepath.Join(n.data, "oci") {
			continue // the OCI data directory's bind onto itself, released when the node closes
		}
		if !strings.Contains(l, warm) {
			t.Errorf("mount left under the data directory: %s", l)
			continue
		}
		for _, opt := range strings.Split(l, ",") {
			if lower, ok := strings.CutPrefix(opt, "lowerdir="); ok {
				if _, err := os.Stat(lower); err != nil {
					t.Errorf("warm root on a removed template: %s", l)
				}
			}
		}
	}
	files, _ := filepath.Glob("/sys/block/loop*/loop/backing_file")
	for _, f := range files {
		if b, _ := os.ReadFile(f); strings.HasPrefix(string(b), n.data) && !strings.HasPrefix(string(b), warm) {
			t.Errorf("loop device left: %s → %s", f, strings.TrimSpace(string(b)))
		}
	}
}

// TestBuildBadImages runs builds from broken or hostile images: each ends in error at
// the base step with a reason that says what is wrong, registers nothing, leaks
// nothing, and the node goes on building.
func TestBuildBadImages(t *testing.T) {
	n := newRealNode(t, Config{})
	reg := newTestRegistry(t)
	reg.user, reg.pass, reg.secret = "alice", "s3cret", "private"
	baseLayer := layerOf(t, dirLayer(t, filepath.Join(n.data, "templates", "base", "rootfs")), types.OCILayer)
	withTop := func(ents ...hdr) v1.Image {
		return imageOf(t, baseLayer, layerOf(t, layerTar(t, ents...), types.OCILayer))
	}
	private := reg.push(t, "private/app:1", withTop(hdr{name: "etc/private", body: "yes\n"}))
	corrupt := withTop(hdr{name: "corrupt", body: strings.Repeat("c", 4096)})
	reg.spoil[topDigest(t, corrupt)] = func(b []byte) []byte {
		b = bytes.Clone(b)
		b[len(b)/2] ^= 0xff
		return b
	}
	truncated := withTop(hdr{name: "truncated", body: strings.Repeat("t", 4096)})
	reg.spoil[topDigest(t, truncated)] = func(b []byte) []byte { return b[:len(b)/2] }
	weird := imageOf(t, baseLayer, layerOf(t, layerTar(t, hdr{name: "x", body: "x"}), "application/vnd.example.weird"))

	tests := []struct {
		name  string
		ref   string
		creds *image.Credentials
		want  []string // all in the reason
	}{
		{"unknown image", reg.host + "/nope:1", nil, []string{"image not found"}},
		{"no credentials", private, nil, []string{"refused the credentials"}},
		{"wrong credentials", private, &image.Credentials{Username: "alice", Password: "wrong"}, []string{"refused the credentials"}},
		{"registry down", "127.0.0.1:1/down:1", nil, []string{"127.0.0.1:1", "connection refused"}},
		{"corrupt layer", reg.push(t, "corrupt:1", corrupt), nil, []string{"digest mismatch"}},
		{"truncated layer", reg.push(t, "truncated:1", truncated), nil, []string{"layer 2"}},
		{"unsupported media type", reg.push(t, "weird:1", weird), nil, []string{"unsupported media type", "application/vnd.example.weird"}},
		{"absolute path", reg.push(t, "abs:1", withTop(hdr{name: "/etc/evil", body: "x"})), nil, []string{"unsafe path", "/etc/evil"}},
		{"dot-dot path", reg.push(t, "dotdot:1", withTop(hdr{name: "../../evil", body: "x"})), nil, []string{"unsafe path", "../../evil"}},
		{"hard link out", reg.push(t, "linkout:1", withTop(hdr{name: "h", typ: tar.TypeLink, link: "../../../etc/passwd"})), nil,
			[]string{"unsafe path"}},
		{"no sh", reg.push(t, "nosh:1", imageOf(t, layerOf(t, layerTar(t, hdr{name: "etc/passwd", body: "root:x:0:0::/root:/bin/sh\n"}), types.OCILayer))),
			nil, []string{"cannot run sandboxes", "no /bin/sh"}},
		{"no passwd", reg.push(t, "nopasswd:1", imageOf(t, layerOf(t, layerTar(t, hdr{name: "bin/sh", body: "#!", mode: 0o755}), types.OCILayer))),
			nil, []string{"cannot run sandboxes", "no /etc/passwd"}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			name := strings.ReplaceAll(tt.name, " ", "-")
			rec := n.build(t, name, Spec{FromImage: tt.ref, Registry: tt.creds, Steps: []Step{{Type: StepRun, Args: []string{"true"}}}})
			if rec.Status != StatusError || rec.Reason == nil || rec.Reason.Step != "base" {
				t.Fatalf("record = %s %+v, want an error at the base step\n%s", rec.Status, rec.Reason, n.logText(rec.ID))
			}
			t.Logf("step %s: %s", rec.Reason.Step, rec.Reason.Message)
			for _, w := range tt.want {
				if !strings.Contains(rec.Reason.Message, w) {
					t.Errorf("reason %q lacks %q", rec.Reason.Message, w)
				}
			}
			if _, err := n.cat.Templates().Resolve(name); err == nil {
				t.Error("a failed build registered its template")
			}
			n.noLeaks(t)
		})
	}
	// Credentials given with the build pull the private image, and are not stored.
	rec := n.build(t, "private-ok", Spec{FromImage: private, Registry: &image.Credentials{Username: "alice", Password: "s3cret"},
		Steps: []Step{{Type: StepRun, Args: []string{"grep -q yes /etc/private"}}}})
	if rec.Status != StatusReady {
		t.Fatalf("build with credentials: %s %+v\n%s", rec.Status, rec.Reason, n.logText(rec.ID))
	}
	raw, err := os.ReadFile(filepath.Join(n.data, "builds", rec.ID+".json"))
	if err != nil || bytes.Contains(raw, []byte("s3cret")) || bytes.Contains([]byte(n.logText(rec.ID)), []byte("s3cret")) {
		t.Errorf("the registry password was stored (%v):\n%s", err, raw)
	}
	n.noLeaks(t)
}

// TestBuildOddLayers builds on images with entries that are legal but easy to get
// wrong: hard links to a file of a lower layer, device nodes (which must not reach the
// host's devices from the sandbox) and a huge sparse file (which must not fill the disk).
func TestBuildOddLayers(t *testing.T) {
	for _, layered := range []bool{false, true} {
		t.Run(map[bool]string{false: "directory", true: "layered"}[layered], func(t *testing.T) { testOddLayers(t, layered) })
	}
}

// testOddLayers runs TestBuildOddLayers on a node whose roots are directories, or (with
// layered) on one that converts images into sealed ext4 layers first.
func testOddLayers(t *testing.T, layered bool) {
	n := newNode(t, Config{}, layered)
	reg := newTestRegistry(t)
	baseLayer := layerOf(t, dirLayer(t, filepath.Join(n.data, "templates", "base", "rootfs")), types.OCILayer)
	lower := layerOf(t, layerTar(t, hdr{name: "data/", typ: tar.TypeDir}, hdr{name: "data/file", body: "from the lower layer\n"}), types.OCILayer)
	upper := layerOf(t, layerTar(t,
		hdr{name: "links/", typ: tar.TypeDir},
		hdr{name: "links/file", typ: tar.TypeLink, link: "data/file"},
		hdr{name: "hostmem", typ: tar.TypeChar, major: 1, minor: 1}, // the host's /dev/mem
	), types.OCILayer)
	const hugeSize = 1 << 30
	huge := sparseLayer(t, "huge", hugeSize)
	ref := reg.push(t, "odd:1", imageOf(t, baseLayer, lower, upper, huge))

	rec := n.build(t, "odd", Spec{FromImage: ref, Steps: []Step{{Type: StepRun, Args: []string{`set -e
[ "$(cat /links/file)" = "from the lower layer" ]
[ "$(stat -c %i /links/file)" = "$(stat -c %i /data/file)" ]
if head -c 1 /hostmem >/dev/null 2>&1; then echo "the host's memory device is readable"; exit 1; fi
[ "$(stat -c %s /huge)" = "` + strconv.Itoa(hugeSize) + `" ]
[ "$(tail -c 5 /huge)" = tail ]`}}}})
	if rec.Status != StatusReady {
		t.Fatalf("build: %s %+v\n%s", rec.Status, rec.Reason, n.logText(rec.ID))
	}
	if layered && !strings.Contains(n.logText(rec.ID), "converted now") {
		t.Errorf("the image was not converted into layers:\n%s", n.logText(rec.ID))
	}
	// The import holds the huge file as a hole.
	tpls, _ := n.cat.Templates().List(catalog.KindTemplate)
	for _, tp := range tpls {
		if !strings.HasPrefix(tp.ID, "img-") {
			continue
		}
		var st syscall.Stat_t
		if err := syscall.Stat(filepath.Join(tp.RootFSDir, "huge"), &st); err != nil {
			t.Fatal(err)
		}
		if st.Size != hugeSize || st.Blocks*512 > 1<<20 {
			t.Errorf("imported huge file: size %d, %d bytes allocated", st.Size, st.Blocks*512)
		}
	}
	n.noLeaks(t)
}

// sparseLayer is a gzipped layer with one file of size bytes, all zeros but its last
// line: what a sparse file's holes read as. Its tar streams size bytes; gzipped it is
// about a thousandth of that.
func sparseLayer(t *testing.T, name string, size int64) v1.Layer {
	t.Helper()
	var buf bytes.Buffer
	zw, _ := gzip.NewWriterLevel(&buf, gzip.BestSpeed)
	tw := tar.NewWriter(zw)
	if err := tw.WriteHeader(&tar.Header{Name: name, Mode: 0o644, Size: size, Typeflag: tar.TypeReg}); err != nil {
		t.Fatal(err)
	}
	zero := make([]byte, 1<<20)
	for left := size - 5; left > 0; left -= int64(len(zero)) {
		if _, err := tw.Write(zero[:min(int64(len(zero)), left)]); err != nil {
			t.Fatal(err)
		}
	}
	tw.Write([]byte("tail\n"))
	if err := tw.Close(); err != nil {
		t.Fatal(err)
	}
	zw.Close()
	gz := buf.Bytes()
	l, err := tarball.LayerFromOpener(func() (io.ReadCloser, error) { return io.NopCloser(bytes.NewReader(gz)), nil },
		tarball.WithMediaType(types.OCILayer))
	if err != nil {
		t.Fatal(err)
	}
	return l
}

// TestBuildDiskFull fills the build sandbox's disk (a layered root of a fixed size) in a
// RUN step: the build fails at that step saying so, registers nothing, leaks nothing,
// and the next build on the node works.
func TestBuildDiskFull(t *testing.T) {
	n := newNode(t, Config{}, true)
	ctx := context.Background()
	// The smallest disk: the base template's own size (512 MiB), not the node default.
	rec, err := n.svc.Request(ctx, RequestOptions{Name: "fill", Resources: sandbox.Resources{DiskSizeMB: 64}})
	if err != nil {
		t.Fatal(err)
	}
	if err := n.svc.Start(ctx, rec.TemplateID, rec.ID, Spec{FromTemplate: "base", Steps: []Step{
		{Type: StepRun, Args: []string{"dd if=/dev/zero of=/home/user/fill bs=1M count=1024", "root"}}}}); err != nil {
		t.Fatal(err)
	}
	rec = n.wait(t, rec)
	if rec.Status != StatusError || rec.Reason == nil || rec.Reason.Step != "1" ||
		!strings.Contains(rec.Reason.Message, "No space left on device") {
		t.Fatalf("record = %s %+v, want an error at step 1 saying the disk is full\n%s", rec.Status, rec.Reason, n.logText(rec.ID))
	}
	if _, err := n.cat.Templates().Resolve("fill"); err == nil {
		t.Error("the failed build registered its template")
	}
	n.noLeaks(t)
	if after := n.build(t, "after-fill", Spec{FromTemplate: "base", Steps: []Step{{Type: StepRun, Args: []string{"df -m / | tail -1"}}}}); after.Status != StatusReady {
		t.Fatalf("build after the full disk: %s %+v\n%s", after.Status, after.Reason, n.logText(after.ID))
	}
	n.noLeaks(t)
}
