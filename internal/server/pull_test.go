package server

import (
	"archive/tar"
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"io"
	"log"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"testing"

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
	"github.com/aenv-dev/aenv/internal/server/api"
	"github.com/aenv-dev/aenv/internal/snapshot"
)

// pullImage is a one-layer image whose /app holds body.
func pullImage(t *testing.T, body string) v1.Image {
	t.Helper()
	var buf bytes.Buffer
	tw := tar.NewWriter(&buf)
	for _, f := range []struct {
		name, body string
		mode       int64
	}{{"app", body, 0o644}, {"etc/passwd", "root:x:0:0::/root:/bin/sh\n", 0o644}, {"bin/sh", "#!", 0o755}} {
		tw.WriteHeader(&tar.Header{Name: f.name, Mode: f.mode, Size: int64(len(f.body)), Typeflag: tar.TypeReg})
		tw.Write([]byte(f.body))
	}
	tw.Close()
	b := buf.Bytes()
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
	cf.Config.Env = []string{"FROM_IMAGE=" + body}
	img, err = mutate.ConfigFile(mutate.MediaType(img, types.OCIManifestSchema1), cf)
	if err != nil {
		t.Fatal(err)
	}
	return img
}

// pullRegistry serves an in-process registry on loopback (reached over http, as pull
// does for loopback hosts) and returns its host:port.
func pullRegistry(t *testing.T) string {
	t.Helper()
	srv := httptest.NewServer(registry.New(registry.Logger(log.New(io.Discard, "", 0))))
	t.Cleanup(srv.Close)
	return strings.TrimPrefix(srv.URL, "http://")
}

func pushImage(t *testing.T, ref string, img v1.Image) {
	t.Helper()
	r, err := name.ParseReference(ref)
	if err != nil {
		t.Fatal(err)
	}
	if err := remote.Write(r, img); err != nil {
		t.Fatal(err)
	}
}

type pullEnv struct {
	*env
	cat  *catalog.Catalog
	data string
	pub  *pullPublisher
	mu   sync.Mutex
	used map[string]bool // rootfs directories "sandboxes" run on
}

// pullPublisher records what the puller publishes.
type pullPublisher struct {
	mu  sync.Mutex
	got []catalog.Template
}

func (p *pullPublisher) PublishTemplate(_ context.Context, t catalog.Template, _ string) (*snapshot.Handle, error) {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.got = append(p.got, t)
	return nil, nil
}

func (p *pullPublisher) published() []catalog.Template {
	p.mu.Lock()
	defer p.mu.Unlock()
	return slices.Clone(p.got)
}

func (e *pullEnv) use(dir string, on bool) {
	e.mu.Lock()
	defer e.mu.Unlock()
	e.used[dir] = on
}

func newPullEnv(t *testing.T, canConvert bool) *pullEnv {
	t.Helper()
	data := t.TempDir()
	cat, err := catalog.Open(filepath.Join(data, "aenv.db"))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { cat.Close() })
	e := &pullEnv{cat: cat, data: data, pub: &pullPublisher{}, used: map[string]bool{}}
	p := &Puller{Templates: cat.Templates(), DataDir: data, CanConvert: func() bool { return canConvert },
		Publisher: e.pub, InUse: func(dir string) bool {
			e.mu.Lock()
			defer e.mu.Unlock()
			return e.used[dir]
		}}
	e.env = newEnv(t, func(o *Options) { o.Pulls = p })
	return e
}

// pull posts body and returns the stream's events; the last one is the outcome.
func (e *pullEnv) pull(body string) pullEvents {
	e.t.Helper()
	rec := e.do(http.MethodPost, "/aenv/templates/pull", body)
	if rec.Code != http.StatusOK {
		e.t.Fatalf("status = %d: %s", rec.Code, rec.Body)
	}
	if ct := rec.Header().Get("Content-Type"); ct != "application/x-ndjson" {
		e.t.Fatalf("Content-Type = %q", ct)
	}
	var evs pullEvents
	sc := bufio.NewScanner(rec.Body)
	for sc.Scan() {
		var ev api.TemplatePullEvent
		if err := json.Unmarshal(sc.Bytes(), &ev); err != nil {
			e.t.Fatalf("line %q: %v", sc.Text(), err)
		}
		evs = append(evs, ev)
	}
	if len(evs) == 0 {
		e.t.Fatal("empty stream")
	}
	return evs
}

func (e *pullEnv) templates() []catalog.Template {
	e.t.Helper()
	ts, err := e.cat.Templates().List("")
	if err != nil {
		e.t.Fatal(err)
	}
	return ts
}

func TestPullTemplate(t *testing.T) {
	reg := pullRegistry(t)
	pushImage(t, reg+"/team/app:v1", pullImage(t, "one"))
	pushImage(t, reg+"/team/app:v2", pullImage(t, "two"))
	e := newPullEnv(t, false)

	evs := e.pull(`{"ref":"` + reg + `/team/app:v1","cpuCount":2,"memoryMB":512,"readyCmd":"true"}`)
	var downloads, applies int
	for _, ev := range evs[:len(evs)-1] {
		if ev.Phase == nil || ev.Layers == nil || *ev.Layers != 1 {
			t.Fatalf("progress event %+v", ev)
		}
		switch image.Phase(*ev.Phase) {
		case image.PhaseDownload:
			downloads++
		case image.PhaseApply:
			applies++
		}
	}
	if downloads == 0 || applies == 0 {
		t.Errorf("progress: %d download and %d apply events", downloads, applies)
	}
	res := evs[len(evs)-1].Template
	if res == nil || len(res.Names) != 1 || res.Names[0] != "app" || *res.Converted || *res.Replaced {
		t.Fatalf("outcome = %+v (error %+v)", res, evs[len(evs)-1].Error)
	}
	v1t, err := e.cat.Templates().Resolve("app")
	if err != nil || v1t.ID != res.TemplateID || v1t.Resources.CPUCount != 2 || v1t.Resources.MemoryMB != 512 ||
		v1t.ReadyCmd != "true" || v1t.EnvVars["FROM_IMAGE"] != "one" {
		t.Fatalf("template = %+v, %v", v1t, err)
	}
	if b, err := os.ReadFile(filepath.Join(v1t.RootFSDir, "app")); err != nil || string(b) != "one" {
		t.Fatalf("rootfs app = %q, %v", b, err)
	}

	if got := e.pub.published(); len(got) != 0 {
		t.Errorf("a directory template was published: %+v", got)
	}

	// Pulling over the name replaces the template like a rebuild: same ID, new root, and
	// the old root stays for sandboxes already running on it.
	e.use(v1t.RootFSDir, true)
	res = e.pull(`{"ref":"` + reg + `/team/app:v2","name":"app"}`).Template()
	if res == nil || res.TemplateID != v1t.ID || !*res.Replaced || len(res.Names) != 1 || res.Names[0] != "app" {
		t.Fatalf("replace outcome = %+v", res)
	}
	v2t, err := e.cat.Templates().Resolve("app")
	if err != nil || v2t.ID != v1t.ID || v2t.RootFSDir == v1t.RootFSDir || v2t.EnvVars["FROM_IMAGE"] != "two" ||
		!v2t.CreatedAt.Equal(v1t.CreatedAt) {
		t.Fatalf("replaced template = %+v, %v", v2t, err)
	}
	if b, err := os.ReadFile(filepath.Join(v2t.RootFSDir, "app")); err != nil || string(b) != "two" {
		t.Fatalf("new rootfs app = %q, %v", b, err)
	}
	if b, err := os.ReadFile(filepath.Join(v1t.RootFSDir, "app")); err != nil || string(b) != "one" {
		t.Fatalf("old rootfs went away under running sandboxes: %q, %v", b, err)
	}
	if n := len(e.templates()); n != 1 {
		t.Errorf("%d templates after a replace, want 1", n)
	}
	// Once no sandbox runs on the old root, the next replace removes it, and the root
	// it replaces (unused) at once.
	e.use(v1t.RootFSDir, false)
	if res := e.pull(`{"ref":"` + reg + `/team/app:v1","name":"app"}`).Template(); res == nil || !*res.Replaced {
		t.Fatalf("second replace: %+v", res)
	}
	for _, d := range []string{v1t.RootFSDir, v2t.RootFSDir} {
		if _, err := os.Stat(filepath.Dir(d)); !os.IsNotExist(err) {
			t.Errorf("replaced template files %s remain: %v", d, err)
		}
	}
	v3t, _ := e.cat.Templates().Resolve("app")
	if b, err := os.ReadFile(filepath.Join(v3t.RootFSDir, "app")); err != nil || string(b) != "one" {
		t.Fatalf("current rootfs app = %q, %v", b, err)
	}

	// Snapshots and the node's own base template are not replaced by a pull.
	if err := e.cat.Templates().Put(catalog.Template{ID: "base", Kind: catalog.KindTemplate, RootFSDir: t.TempDir()}); err != nil {
		t.Fatal(err)
	}
	ev := e.pull(`{"ref":"` + reg + `/team/app:v1","name":"base"}`)
	if last := ev[len(ev)-1]; last.Error == nil || last.Error.Code != http.StatusConflict {
		t.Errorf("pull over base: %+v", last)
	}
}

// Template returns the outcome of a stream (its last event).
func (evs pullEvents) Template() *api.TemplatePullResult { return evs[len(evs)-1].Template }

type pullEvents []api.TemplatePullEvent

func TestPullTemplateBadInput(t *testing.T) {
	reg := pullRegistry(t)
	pushImage(t, reg+"/app:v1", pullImage(t, "one"))
	e := newPullEnv(t, false)
	for _, tc := range []struct{ body, msg string }{
		{``, "body is required"},
		{`{`, "not valid JSON"},
		{`{"name":"x"}`, "ref is required"},
		{`{"ref":"  "}`, "ref is required"},
		{`{"ref":"has space:1"}`, "bad image reference"},
		{`{"ref":"UPPER/Case::x"}`, "ref"},
		{`{"ref":"oci:"}`, "no path"},
		{`{"ref":"` + reg + `/app:v1","name":"bad name"}`, "template name"},
		{`{"ref":"` + reg + `/app:v1","cpuCount":-1}`, "negative"},
		{`{"ref":"` + reg + `/app:v1","platform":"linux"}`, "os/arch"},
		{`{"ref":"` + reg + `/app:v1","user":"app:grp"}`, "without a group"},
	} {
		wantError(t, e.do(http.MethodPost, "/aenv/templates/pull", tc.body), http.StatusBadRequest, tc.msg)
	}
	wantError(t, e.doWith(http.MethodPost, "/aenv/templates/pull", `{"ref":"`+reg+`/app:v1"}`, nil),
		http.StatusUnauthorized, "API key")

	// Failures once the stream has started end it with an error event and leave nothing.
	for _, tc := range []struct {
		body string
		code int32
	}{
		{`{"ref":"127.0.0.1:1/nobody/home:v1","name":"gone"}`, http.StatusBadGateway},
		{`{"ref":"` + reg + `/missing:v1","name":"gone"}`, http.StatusNotFound},
	} {
		evs := e.pull(tc.body)
		last := evs[len(evs)-1]
		if last.Error == nil || last.Error.Code != tc.code || last.Error.Message == "" || last.Template != nil {
			t.Errorf("%s: outcome %+v, error %+v; want code %d", tc.body, last, last.Error, tc.code)
		}
	}
	if ts := e.templates(); len(ts) != 0 {
		t.Errorf("failed pulls registered %+v", ts)
	}
	if ents, _ := os.ReadDir(filepath.Join(e.data, "templates")); len(ents) != 0 {
		t.Errorf("failed pulls left %d template directories", len(ents))
	}

	// A node without pulls says so.
	wantError(t, newEnv(t).do(http.MethodPost, "/aenv/templates/pull", `{"ref":"x"}`), http.StatusNotImplemented, "not enabled")
}

func TestPullTemplateConvertDefault(t *testing.T) {
	ref := `{"ref":"127.0.0.1:5000/app"}`
	for _, tc := range []struct {
		layered bool
		body    string
		want    bool
	}{
		{true, ref, true},
		{false, ref, false},
		{true, `{"ref":"127.0.0.1:5000/app","convert":false}`, false},
		{false, `{"ref":"127.0.0.1:5000/app","convert":true}`, true},
	} {
		p := &Puller{CanConvert: func() bool { return tc.layered }}
		var b api.TemplatePullRequest
		if err := json.Unmarshal([]byte(tc.body), &b); err != nil {
			t.Fatal(err)
		}
		req, err := p.request(b)
		if err != nil || req.Convert != tc.want || req.Name != "app" {
			t.Errorf("layered=%v %s: convert=%v name=%q err=%v, want convert=%v", tc.layered, tc.body, req.Convert, req.Name, err, tc.want)
		}
	}
}

func TestPullTemplateConvert(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("conversion needs root (FUSE, loop devices, mkfs.ext4)")
	}
	for _, p := range []string{"/dev/fuse", "/dev/loop-control"} {
		if _, err := os.Stat(p); err != nil {
			t.Skipf("conversion needs %s", p)
		}
	}
	reg := pullRegistry(t)
	pushImage(t, reg+"/conv:v1", pullImage(t, "layered"))
	// The layered node's default converts.
	e := newPullEnv(t, true)
	evs := e.pull(`{"ref":"` + reg + `/conv:v1","diskSizeMB":64}`)
	res := evs.Template()
	if res == nil || !*res.Converted {
		t.Fatalf("outcome %+v (error %+v)", res, evs[len(evs)-1].Error)
	}
	converts := 0
	for _, ev := range evs {
		if ev.Phase != nil && image.Phase(*ev.Phase) == image.PhaseConvert {
			converts++
		}
	}
	if converts == 0 {
		t.Error("no convert progress streamed")
	}
	tpl, err := e.cat.Templates().Resolve("conv")
	if err != nil {
		t.Fatal(err)
	}
	// Sandboxes from it get a layered block root, which is what snapshot and fork need.
	fs, err := tpl.Layers()
	if err != nil || fs == nil || fs.SizeMB != 64 {
		t.Fatalf("layers = %+v, %v", fs, err)
	}
	// It is published with its layers, so nodes sharing the repository see it.
	got := e.pub.published()
	if len(got) != 1 || got[0].ID != tpl.ID {
		t.Fatalf("published %+v, want %s once", got, tpl.ID)
	}
	if m, err := snapshot.ManifestFromTemplate(got[0], ""); err != nil || len(m.Layers) != len(fs.Layers) || m.Name != "conv" {
		t.Errorf("manifest of the pulled template: %+v, %v", m, err)
	}
}

// TestPullTemplateUser: a pull makes the image's USER the default user, as a build does
// (by uid here), the request's user overrides it, and one the image has no account for
// is refused with nothing registered. Replacing a template hands the old version to
// Retired (warm containers, GC).
func TestPullTemplateUser(t *testing.T) {
	reg := pullRegistry(t)
	img := pullImage(t, "one")
	cf, _ := img.ConfigFile()
	cf = cf.DeepCopy()
	cf.Config.User = "0:0"
	img, err := mutate.ConfigFile(img, cf)
	if err != nil {
		t.Fatal(err)
	}
	pushImage(t, reg+"/app:v1", img)
	e := newPullEnv(t, false)
	var retired []catalog.Template
	e.srv.puller.Retired = func(_ context.Context, old catalog.Template) { retired = append(retired, old) }

	res := e.pull(`{"ref":"` + reg + `/app:v1"}`).Template()
	if res == nil {
		t.Fatal("pull failed")
	}
	got, err := e.cat.Templates().Resolve("app")
	if err != nil || got.DefaultUser != "root" || got.DefaultWorkdir != "/home/user" {
		t.Fatalf("image USER 0: template %+v, %v", got, err)
	}
	if _, err := os.Stat(filepath.Join(got.RootFSDir, "home/user")); err != nil {
		t.Errorf("/home/user: %v", err)
	}
	if len(retired) != 0 {
		t.Errorf("a new template retired %+v", retired)
	}
	res = e.pull(`{"ref":"` + reg + `/app:v1","name":"app","user":"user"}`).Template()
	if res == nil || !*res.Replaced {
		t.Fatalf("replace: %+v", res)
	}
	if got2, _ := e.cat.Templates().Resolve("app"); got2.DefaultUser != "user" {
		t.Errorf("user override: default user %q", got2.DefaultUser)
	}
	if len(retired) != 1 || retired[0].ID != got.ID || retired[0].RootFSDir != got.RootFSDir {
		t.Errorf("retired after a replace: %+v, want the old version", retired)
	}
	evs := e.pull(`{"ref":"` + reg + `/app:v1","name":"other","user":"ghost"}`)
	if last := evs[len(evs)-1]; last.Error == nil || last.Error.Code != http.StatusBadRequest || !strings.Contains(last.Error.Message, "ghost") {
		t.Errorf("unknown user: %+v", last)
	}
	if _, err := e.cat.Templates().Resolve("other"); err == nil {
		t.Error("a pull with an unknown user was registered")
	}
}
