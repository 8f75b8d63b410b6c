package main

import (
	"bytes"
	"context"
	"fmt"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/aenv-dev/aenv/internal/apikey"
	"github.com/aenv-dev/aenv/internal/catalog"
	"github.com/aenv-dev/aenv/internal/image"
	"github.com/aenv-dev/aenv/internal/image/imagetest"
	"github.com/aenv-dev/aenv/internal/image/install"
	"github.com/aenv-dev/aenv/internal/node"
	"github.com/aenv-dev/aenv/internal/orchestrator"
	"github.com/aenv-dev/aenv/internal/sandbox"
	"github.com/aenv-dev/aenv/internal/sandbox/mock"
	"github.com/aenv-dev/aenv/internal/server"
	"github.com/aenv-dev/aenv/internal/template/build"
)

func pullTestLayout(t *testing.T) string {
	return layoutOf(t, layoutFile{Name: "hello", Body: "hi", Mode: 0o644}, layoutFile{Name: "bin/sh", Body: "#!", Mode: 0o755},
		layoutFile{Name: "etc/passwd", Body: "root:x:0:0::/root:/bin/sh\n", Mode: 0o644})
}

type layoutFile = imagetest.File

// layoutOf writes a one-layer image of files to an OCI layout.
func layoutOf(t *testing.T, files ...layoutFile) string {
	t.Helper()
	return imagetest.Layout(t, "", image.HostPlatform().Architecture, nil, files...)
}

func runPull(t *testing.T, args ...string) (string, string, error) {
	t.Helper()
	cmd := newPullCmd(&globals{})
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

// TestPullProgressLines: three layers downloading at once, then applied, print one line
// per layer and phase, each complete, none rewritten (no carriage return, no erase).
func TestPullProgressLines(t *testing.T) {
	var buf bytes.Buffer
	p := newPullProgress(&buf)
	dl := func(layer int, done int64, final bool) {
		p.report(image.Progress{Phase: image.PhaseDownload, Layer: layer, Layers: 3, Digest: fmt.Sprintf("sha256:%d0123456789abcdef", layer),
			Done: done, Total: 3 << 20, Final: final})
	}
	dl(1, 1<<20, false)
	dl(2, 1<<20, false)
	dl(1, 2<<20, false)
	p.report(image.Progress{Phase: image.PhaseDownload, Layer: 3, Layers: 3, Digest: "sha256:ff", Total: 5, Cached: true, Final: true})
	dl(2, 3<<20, true)
	dl(1, 3<<20, true)
	for l := 1; l <= 3; l++ {
		p.report(image.Progress{Phase: image.PhaseApply, Layer: l, Layers: 3, Digest: "sha256:aa", Done: 1, Total: 1, Final: true})
	}
	got := buf.String()
	if strings.ContainsAny(got, "\r\033") {
		t.Fatalf("output rewrites lines: %q", got)
	}
	lines := strings.Split(strings.TrimSuffix(got, "\n"), "\n")
	want := []string{
		"download layer 3/3 sha256:ff cached",
		"download layer 2/3 sha256:20123456789a 3.0 MiB",
		"download layer 1/3 sha256:10123456789a 3.0 MiB",
		"apply    layer 1/3 sha256:aa 1 B",
		"apply    layer 2/3 sha256:aa 1 B",
		"apply    layer 3/3 sha256:aa 1 B",
	}
	if len(lines) != len(want) {
		t.Fatalf("lines:\n%s", got)
	}
	for n := range want {
		if !strings.HasPrefix(lines[n], want[n]) {
			t.Errorf("line %d = %q, want %q...", n+1, lines[n], want[n])
		}
	}
}

// pullNode is node() with pulls and template listing enabled, over its own data dir.
func pullNode(t *testing.T) (string, *catalog.Catalog) {
	t.Helper()
	data := t.TempDir()
	cat, err := catalog.Open(filepath.Join(data, catalogFile))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { cat.Close() })
	if err := cat.Templates().Put(catalog.Template{ID: node.BaseTemplateID, Kind: catalog.KindTemplate, RootFSDir: t.TempDir()}); err != nil {
		t.Fatal(err)
	}
	if _, err := cat.APIKeys().Add("test", testKey); err != nil {
		t.Fatal(err)
	}
	reg := prometheus.NewRegistry()
	orch, err := orchestrator.New(orchestrator.Config{Registerer: reg}, mock.New(mock.Options{}), cat)
	if err != nil {
		t.Fatal(err)
	}
	if err := orch.Start(context.Background()); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		orch.Shutdown(ctx)
	})
	builds, err := build.New(build.Config{DataDir: data}, orch, cat.Templates())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(builds.Close)
	srv, err := server.New(server.Options{Orchestrator: orch, Auth: apikey.NewVerifier(cat.APIKeys()), Builds: builds,
		Pulls:    &server.Puller{Templates: cat.Templates(), DataDir: data, CanConvert: func() bool { return node.LayeredTemplate(cat, node.BaseTemplateID) }},
		Registry: reg})
	if err != nil {
		t.Fatal(err)
	}
	hs := httptest.NewServer(srv)
	t.Cleanup(hs.Close)
	return hs.URL, cat
}

// TestPullThroughNode is issue #5: with a node running, `aenv pull REF --name X` then
// `aenv start X` works, without stopping the node.
func TestPullThroughNode(t *testing.T) {
	url, cat := pullNode(t)
	// Were pull to fall back to the direct path, it would create a catalog here.
	local := t.TempDir()
	t.Setenv("AENV_DATA_DIR", local)
	ref := "oci:" + pullTestLayout(t)

	out, progress, err := aenv(t, url, "pull", ref, "--name", "hello", "--cpu", "2", "--probe", "8080")
	if err != nil {
		t.Fatalf("%v\n%s", err, progress)
	}
	if !strings.Contains(progress, "download layer 1/1") || !strings.Contains(progress, "apply    layer 1/1") ||
		!strings.Contains(progress, "pulled "+ref) {
		t.Errorf("piped progress lines missing:\n%s", progress)
	}
	if _, err := os.Stat(filepath.Join(local, catalogFile)); err == nil {
		t.Fatal("pull wrote a local catalog instead of asking the node")
	}
	id, names, _ := strings.Cut(strings.TrimSpace(out), "\t")
	tpl, err := cat.Templates().Resolve("hello")
	if err != nil || tpl.ID != id || names != "hello" || tpl.ReadyCmd != ": >/dev/tcp/127.0.0.1/8080" || tpl.Resources.CPUCount != 2 {
		t.Fatalf("template = %+v (%v), printed %q", tpl, err, out)
	}
	// The node's base is a directory template here, so the default is not to convert.
	if ls, err := tpl.Layers(); err != nil || ls != nil {
		t.Errorf("converted on a node without layered roots: %+v, %v", ls, err)
	}

	out, _, err = aenv(t, url, "template", "ls")
	if err != nil || !strings.Contains(out, id) || !strings.Contains(out, `"hello"`) {
		t.Fatalf("template ls after pull: %s %v", out, err)
	}
	if sid, _, err := aenv(t, url, "start", "-d", "hello"); err != nil || strings.TrimSpace(sid) == "" {
		t.Fatalf("start from the pulled template: %q %v", sid, err)
	}

	// Errors the node finds are the CLI's errors, and register nothing.
	before, _ := cat.Templates().List("")
	for _, tc := range []struct {
		args []string
		msg  string
	}{
		{[]string{"pull", "has space:1", "--name", "x"}, "bad image reference"},
		{[]string{"pull", ref, "--name", "bad name"}, "template name"},
		{[]string{"pull", "127.0.0.1:1/nobody:v1", "--name", "x"}, "connection refused"},
		{[]string{"pull", ref, "--docker-config", "/dev/null"}, "--docker-config"},
		{[]string{"pull", ref, "--name", "x", "--user", "ghost"}, `unknown user: "ghost" has no account`},
		{[]string{"pull", "oci:" + layoutOf(t, layoutFile{Name: "etc/passwd", Body: "root:x:0:0::/root:/bin/sh\n", Mode: 0o644}), "--name", "x"},
			"no /bin/sh"},
	} {
		if _, _, err := aenv(t, url, tc.args...); err == nil || !strings.Contains(err.Error(), tc.msg) {
			t.Errorf("aenv %q: err = %v, want it to mention %q", tc.args, err, tc.msg)
		}
	}
	if after, _ := cat.Templates().List(""); len(after) != len(before) {
		t.Errorf("failed pulls registered templates: %d -> %d", len(before), len(after))
	}
}

func TestPullBody(t *testing.T) {
	t.Chdir(t.TempDir())
	wd, _ := os.Getwd()
	req := install.Request{Ref: "oci:img/app:v1", Name: "a", Resources: sandbox.Resources{CPUCount: 2}}
	b := pullBody(req, false, "")
	// The node resolves paths against its own cwd, so ours must travel absolute.
	if b.Ref != "oci:"+filepath.Join(wd, "img/app")+":v1" && b.Ref != "oci:"+filepath.Join(wd, "img/app:v1") {
		t.Errorf("ref = %q", b.Ref)
	}
	// Unset --convert lets the node choose; an explicit one is sent either way.
	if b.Convert != nil || b.MemoryMB != nil || b.CpuCount == nil || *b.CpuCount != 2 || *b.Name != "a" {
		t.Errorf("body = %+v", b)
	}
	if b := pullBody(install.Request{Ref: "ubuntu:22.04"}, true, "linux/arm64"); b.Ref != "ubuntu:22.04" ||
		b.Convert == nil || *b.Convert || *b.Platform != "linux/arm64" {
		t.Errorf("body = %+v", b)
	}
}
