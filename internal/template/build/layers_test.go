package build

import (
	"bufio"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net/http"
	"os"
	"path/filepath"
	"reflect"
	"strings"
	"testing"
	"time"

	v1 "github.com/google/go-containerregistry/pkg/v1"

	"github.com/aenv-dev/aenv/internal/catalog"
	"github.com/aenv-dev/aenv/internal/orchestrator"
	"github.com/aenv-dev/aenv/internal/snapshot"
)

// run runs script in sandbox id (as its default user) and returns its trimmed output.
func (n *realNode) run(t *testing.T, sb *orchestrator.Sandbox, script string) string {
	t.Helper()
	ep, _, err := n.orch.Endpoint(context.Background(), sb.ID, false)
	if err != nil {
		t.Fatal(err)
	}
	sess := NewSession(sb.ID, fmt.Sprintf("http://%s", joinHostPort(ep.Host, 49983)), sb.EnvdAccessToken, http.DefaultClient)
	var out strings.Builder
	if err := sess.Run(context.Background(), Command{Script: script, Stdout: &out, Stderr: &out}); err != nil {
		t.Fatalf("%s in %s: %v: %s", script, sb.ID, err, out.String())
	}
	return strings.TrimSpace(out.String())
}

func (n *realNode) create(t *testing.T, tpl string) *orchestrator.Sandbox {
	t.Helper()
	sb, err := n.orch.Create(context.Background(), orchestrator.CreateRequest{TemplateID: tpl, Secure: true})
	if err != nil {
		t.Fatalf("create from %s: %v", tpl, err)
	}
	t.Cleanup(func() { n.orch.Kill(context.Background(), sb.ID) })
	return sb
}

// layerPaths returns the sealed layer files a layered template's stack names.
func layerPaths(t *testing.T, tpl catalog.Template) []string {
	t.Helper()
	files, err := snapshot.ArtifactLayers(tpl.Artifact)
	if err != nil {
		t.Fatal(err)
	}
	var out []string
	for _, f := range files {
		out = append(out, f.Path)
	}
	return out
}

// mountsOf counts the mounts whose path names sandbox id (its root, its upper's
// filesystem): a build sandbox that was not released shows here.
func mountsOf(t *testing.T, id string) int {
	t.Helper()
	f, err := os.Open("/proc/self/mountinfo")
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	n := 0
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		if fields := strings.Fields(sc.Text()); len(fields) > 4 && strings.Contains(fields[4], id) {
			n++
		}
	}
	return n
}

// TestBuildLayered builds on the layered base: the template is the base's sealed layer
// plus the build sandbox's upper sealed in place (no directory, no tar), sandboxes from
// it see the build's files and can snapshot and fork, and rebuilds and deletes free the
// layers nothing uses any more.
func TestBuildLayered(t *testing.T) {
	pub := &recordingPublisher{}
	n := newNode(t, Config{ReadyTimeout: 20 * time.Second, Publisher: pub}, true)
	base, err := n.cat.Templates().Get("base")
	if err != nil {
		t.Fatal(err)
	}
	baseLayers := layerPaths(t, base)
	spec := Spec{FromTemplate: "base", Steps: []Step{
		{Type: StepWorkdir, Args: []string{"/app"}},
		{Type: StepRun, Args: []string{`echo built > built.txt && whoami > who.txt && dd if=/dev/urandom of=blob bs=1k count=64 2>/dev/null && md5sum blob > blob.md5`}},
		{Type: StepEnv, Args: []string{"GREETING", "layered"}},
		{Type: StepExpose, Args: []string{"8080", "53/udp"}},
		{Type: StepLabel, Args: []string{"org.example.team", "agents", "tier", "gold"}},
	}, StartCmd: "echo started > /app/started; exec sleep 600", ReadyCmd: "test -f /app/started"}
	rec := n.build(t, "layered-one", spec)
	if rec.Status != StatusReady {
		t.Fatalf("build %s: %+v\n%s", rec.Status, rec.Reason, n.logText(rec.ID))
	}
	if logs := n.logText(rec.ID); !strings.Contains(logs, "captured 2 sealed layers") {
		t.Errorf("log lacks the layered capture:\n%s", logs)
	}
	tpl, err := n.cat.Templates().Resolve("layered-one")
	if err != nil {
		t.Fatal(err)
	}
	a, ok := layersArtifact(tpl)
	if !ok || tpl.RootFSDir != "" {
		t.Fatalf("template is not layered: rootfs %q artifact %s", tpl.RootFSDir, tpl.Artifact)
	}
	layers := layerPaths(t, tpl)
	if len(layers) != len(baseLayers)+1 || !reflect.DeepEqual(layers[:len(baseLayers)], baseLayers) {
		t.Fatalf("layers %q, want the base's %q and one more", layers, baseLayers)
	}
	// The build sandbox got the node's default disk (2 GiB), grown from the base's 512 MiB.
	if a.VirtualSize != 2048<<20 || a.Overlaybd.SizeMB != 2048 || a.Base != "base" || a.Build != rec.ID || len(a.Capture) == 0 {
		t.Errorf("artifact = %+v", a)
	}
	if _, err := os.Stat(filepath.Join(n.data, "templates", rec.TemplateID)); !os.IsNotExist(err) {
		t.Errorf("a layered build made a template directory: %v", err)
	}
	if !reflect.DeepEqual(tpl.ExposedPorts, []string{"8080", "53/udp"}) ||
		!reflect.DeepEqual(tpl.Labels, map[string]string{"org.example.team": "agents", "tier": "gold"}) ||
		!reflect.DeepEqual(a.Image.ExposedPorts, tpl.ExposedPorts) {
		t.Errorf("expose %q labels %v (artifact %+v)", tpl.ExposedPorts, tpl.Labels, a.Image)
	}
	if tpl.DefaultUser != "user" || tpl.DefaultWorkdir != "/app" || tpl.EnvVars["GREETING"] != "layered" || tpl.StartCmd != spec.StartCmd {
		t.Errorf("template = %+v", tpl)
	}
	if got, inCat := pub.calls(); len(got) != 1 || got[0].ID != rec.TemplateID || !inCat[0] {
		t.Errorf("published %+v (in the catalog: %v), want %s once, registered", got, inCat, rec.TemplateID)
	} else if m, err := snapshot.ManifestFromTemplate(got[0], ""); err != nil || len(m.Layers) != len(layers) {
		t.Errorf("published template's manifest: %+v, %v", m, err)
	}
	n.noSandboxes(t)
	var src struct {
		SourceID string `json:"sourceSandboxID"`
	}
	if err := json.Unmarshal(a.Capture, &src); err != nil || src.SourceID == "" {
		t.Fatalf("capture names no build sandbox: %s (%v)", a.Capture, err)
	}
	if got := mountsOf(t, src.SourceID); got != 0 {
		t.Errorf("%d mounts of the build sandbox %s left", got, src.SourceID)
	}
	if ents, _ := filepath.Glob(filepath.Join(n.data, "oci", "*", src.SourceID)); len(ents) != 0 {
		t.Errorf("the build sandbox's bundle remains: %q", ents)
	}

	// Sandboxes from it see the build's files, and snapshot and fork like any.
	sb := n.create(t, "layered-one")
	if got := n.run(t, sb, `echo "$(whoami) $(pwd) $GREETING $(cat built.txt who.txt started | tr '\n' ' ') $(md5sum -c blob.md5 >/dev/null && echo ok)"`); got != "user /app layered built user started  ok" {
		t.Errorf("sandbox from the template: %q", got)
	}
	n.run(t, sb, "echo mine > /app/mine.txt")
	snap, err := n.orch.Snapshot(context.Background(), sb.ID, "layered-snap")
	if err != nil {
		t.Fatal(err)
	}
	child := n.create(t, snap.SnapshotID)
	if got := n.run(t, child, "cat /app/built.txt /app/mine.txt"); got != "built\nmine" {
		t.Errorf("sandbox from a snapshot of it: %q", got)
	}
	forks, err := n.orch.Fork(context.Background(), sb.ID, 2, time.Minute)
	if err != nil {
		t.Fatal(err)
	}
	for _, f := range forks {
		if f.Err != nil {
			t.Fatalf("fork: %v", f.Err)
		}
		t.Cleanup(func() { n.orch.Kill(context.Background(), f.Sandbox.ID) })
		if got := n.run(t, f.Sandbox, "cat /app/built.txt /app/mine.txt"); got != "built\nmine" {
			t.Errorf("fork sees %q", got)
		}
	}

	// A build can start from the snapshot: it is layered on the snapshot's stack.
	fromSnap := n.build(t, "from-snap", Spec{FromTemplate: snap.SnapshotID,
		Steps: []Step{{Type: StepRun, Args: []string{"cat /app/mine.txt > /app/copied.txt"}}}})
	if fromSnap.Status != StatusReady {
		t.Fatalf("build from a snapshot: %s %+v\n%s", fromSnap.Status, fromSnap.Reason, n.logText(fromSnap.ID))
	}
	snapTpl, _ := n.cat.Templates().Get(snap.SnapshotID)
	fsTpl, _ := n.cat.Templates().Resolve("from-snap")
	if _, ok := layersArtifact(fsTpl); !ok || len(layerPaths(t, fsTpl)) != len(layerPaths(t, snapTpl))+1 {
		t.Errorf("build from a snapshot is not layered on it: %s", fsTpl.Artifact)
	}
	fsb := n.create(t, "from-snap")
	if got := n.run(t, fsb, "cat /app/copied.txt"); got != "mine" {
		t.Errorf("sandbox of the build from a snapshot: %q", got)
	}
	n.orch.Kill(context.Background(), fsb.ID)
	if _, err := n.svc.Delete(context.Background(), "from-snap"); err != nil {
		t.Fatal(err)
	}

	// A rebuild replaces the template; its old layer stays while sandboxes and the
	// snapshot use it, and goes with the last of them.
	old := layers[len(layers)-1]
	small := Spec{FromTemplate: "base", Steps: []Step{{Type: StepRun, Args: []string{"echo v2 > /home/user/v.txt"}}}}
	if r := n.build(t, "layered-one", small); r.Status != StatusReady || r.TemplateID != rec.TemplateID {
		t.Fatalf("rebuild: %+v\n%s", r, n.logText(r.ID))
	}
	if _, err := os.Stat(old); err != nil {
		t.Fatalf("the old build's layer went while sandboxes use it: %v", err)
	}
	tpl2, _ := n.cat.Templates().Get(rec.TemplateID)
	layers2 := layerPaths(t, tpl2)
	v2 := n.create(t, "layered-one")
	if got := n.run(t, v2, "cat /home/user/v.txt; test -e /app/built.txt && echo stale || echo fresh"); got != "v2\nfresh" {
		t.Errorf("sandbox of the rebuilt template: %q", got)
	}
	for _, id := range []string{sb.ID, child.ID, forks[0].Sandbox.ID, forks[1].Sandbox.ID, v2.ID} {
		if err := n.orch.Kill(context.Background(), id); err != nil {
			t.Fatal(err)
		}
	}
	if _, err := os.Stat(old); err != nil {
		t.Fatalf("the old build's layer went while the snapshot uses it: %v", err)
	}
	if err := n.orch.DeleteTemplate(context.Background(), snap.SnapshotID); err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(old); !os.IsNotExist(err) {
		t.Errorf("the old build's layer outlived its last user: %v", err)
	}
	if _, err := n.svc.Delete(context.Background(), "layered-one"); err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(layers2[len(layers2)-1]); !os.IsNotExist(err) {
		t.Errorf("a deleted template's layer remains: %v", err)
	}
	for _, p := range baseLayers {
		if _, err := os.Stat(p); err != nil {
			t.Errorf("the base's layer went with a template built on it: %v", err)
		}
	}
	n.noSandboxes(t)
}

// TestBuildLayeredFromImage builds on an image on a node with layered roots: the import
// is converted into sealed layers, builds on it are captured as layers, the image's
// USER is the default user unless the build sets one (a Dockerfile's steps still run as
// root), and the image's EXPOSE and LABEL are kept with the build's added.
func TestBuildLayeredFromImage(t *testing.T) {
	n := newNode(t, Config{ImageDiskMB: 256}, true)
	dir := baseImage(t, n, func(c *v1.Config) {
		c.User = "65534:65534" // nobody, by uid as images often say
		c.ExposedPorts = map[string]struct{}{"80/tcp": {}}
		c.Labels = map[string]string{"from": "image"}
		c.Cmd = []string{"sleep", "infinity"}
	})
	// E2B SDK steps run as the image's user.
	rec := n.build(t, "img-sdk", Spec{FromImage: "oci:" + dir, Steps: []Step{{Type: StepRun, Args: []string{"id -un > /tmp/who"}}}})
	if rec.Status != StatusReady {
		t.Fatalf("build %s: %+v\n%s", rec.Status, rec.Reason, n.logText(rec.ID))
	}
	df, err := ParseDockerfile(strings.NewReader("FROM oci:"+dir+"\nRUN id -un > /built-by\nEXPOSE 9000\nLABEL team=agents\n"), nil)
	if err != nil {
		t.Fatal(err)
	}
	rec2 := n.build(t, "img-dockerfile", df.Spec())
	if rec2.Status != StatusReady {
		t.Fatalf("build %s: %+v\n%s", rec2.Status, rec2.Reason, n.logText(rec2.ID))
	}
	tpls, err := n.svc.Templates()
	if err != nil {
		t.Fatal(err)
	}
	var imp catalog.Template
	for _, tp := range tpls {
		if strings.HasPrefix(tp.ID, "img-") && tp.ID != "img-sdk" && tp.ID != "img-dockerfile" {
			imp = tp
		}
	}
	if !imp.Layered() {
		t.Fatalf("the image import is not layered: %+v", imp)
	}
	for _, c := range []struct {
		name, script, want string
		expose             []string
		labels             map[string]string
	}{
		{"img-sdk", "id -un; cat /tmp/who", "nobody\nnobody", []string{"80/tcp"}, map[string]string{"from": "image"}},
		{"img-dockerfile", "id -un; cat /built-by", "nobody\nroot", []string{"80/tcp", "9000"},
			map[string]string{"from": "image", "team": "agents"}},
	} {
		tpl, err := n.svc.Resolve(c.name)
		if err != nil {
			t.Fatal(err)
		}
		if _, ok := layersArtifact(tpl); !ok || tpl.RootFSDir != "" {
			t.Errorf("%s is not layered: %q %s", c.name, tpl.RootFSDir, tpl.Artifact)
		}
		if tpl.DefaultUser != "nobody" || !reflect.DeepEqual(tpl.ExposedPorts, c.expose) || !reflect.DeepEqual(tpl.Labels, c.labels) ||
			!reflect.DeepEqual(tpl.Cmd, []string{"sleep", "infinity"}) {
			t.Errorf("%s: user %q expose %q labels %v cmd %q", c.name, tpl.DefaultUser, tpl.ExposedPorts, tpl.Labels, tpl.Cmd)
		}
		sb := n.create(t, c.name)
		if got := n.run(t, sb, c.script); got != c.want {
			t.Errorf("%s: %q, want %q", c.name, got, c.want)
		}
		n.orch.Kill(context.Background(), sb.ID)
	}
	// The SDKs' user exists whatever the image's USER.
	sb := n.create(t, "img-sdk")
	if got := n.run(t, sb, "stat -c %U /home/user"); got != "user" {
		t.Errorf("/home/user is owned by %q", got)
	}
}

// TestBuildCaptureReclaimed: a node that stopped between capturing a layered build and
// registering its template gives the capture back at its next start, and keeps one
// whose template was registered.
func TestBuildCaptureReclaimed(t *testing.T) {
	ctx := context.Background()
	n := newNode(t, Config{}, true)
	capture := func() (json.RawMessage, string) {
		sb := n.create(t, "base")
		n.run(t, sb, "echo x > /home/user/x")
		raw, err := n.orch.CaptureSandbox(ctx, sb.ID)
		if err != nil {
			t.Fatal(err)
		}
		if err := n.orch.Kill(ctx, sb.ID); err != nil {
			t.Fatal(err)
		}
		var c captureOf
		if err := json.Unmarshal(raw, &c); err != nil {
			t.Fatal(err)
		}
		return raw, c.Layers[len(c.Layers)-1].Path
	}
	orphan, orphanLayer := capture()
	kept, keptLayer := capture()
	art, _ := json.Marshal(LayersArtifact{Kind: LayersArtifactKind, Capture: kept})
	if err := n.cat.Templates().Put(catalog.Template{ID: "registered", Kind: catalog.KindTemplate, Artifact: art}); err != nil {
		t.Fatal(err)
	}
	for _, r := range []*Record{
		{ID: "b-orphan", TemplateID: "unregistered", Name: "unregistered", Status: StatusBuilding, Capture: orphan},
		{ID: "b-kept", TemplateID: "registered", Name: "registered", Status: StatusBuilding, Capture: kept},
	} {
		if err := n.svc.store.put(r); err != nil {
			t.Fatal(err)
		}
	}
	for _, p := range []string{orphanLayer, keptLayer} {
		if _, err := os.Stat(p); err != nil {
			t.Fatalf("captured layer missing before the restart: %v", err)
		}
	}
	svc, err := New(Config{DataDir: n.data, Logger: n.svc.cfg.Logger}, n.orch, n.cat.Templates())
	if err != nil {
		t.Fatal(err)
	}
	svc.Close()
	if _, err := os.Stat(orphanLayer); !os.IsNotExist(err) {
		t.Errorf("the interrupted build's layer remains: %v", err)
	}
	if _, err := os.Stat(keptLayer); err != nil {
		t.Errorf("the registered template's layer went: %v", err)
	}
	if r, _ := svc.store.get("b-orphan"); r.Status != StatusError {
		t.Errorf("interrupted build is %s", r.Status)
	}
}

// fakeCapturer answers CaptureSandbox with raw or err and records discards.
type fakeCapturer struct {
	raw       json.RawMessage
	err       error
	discarded []json.RawMessage
}

func (f *fakeCapturer) CaptureSandbox(context.Context, string) (json.RawMessage, error) {
	return f.raw, f.err
}
func (f *fakeCapturer) DiscardCapture(_ context.Context, raw json.RawMessage) error {
	f.discarded = append(f.discarded, raw)
	return nil
}

// fallbackCapturer stands in for TarCapture.
type fallbackCapturer struct{ called bool }

func (f *fallbackCapturer) Capture(context.Context, *Session, string, func(string, string)) (Captured, error) {
	f.called = true
	return Captured{RootFSDir: "/fallback"}, nil
}

func TestSnapshotCapture(t *testing.T) {
	good := json.RawMessage(`{"id":"cap-1","layers":[{"path":"/l/base","uuid":"u1"},{"path":"/l/top","uuid":"u2"}],"virtualSize":1073741825,"resources":{"cpuCount":2}}`)
	for _, tc := range []struct {
		name               string
		raw                json.RawMessage
		err                error
		wantErr, fallback  bool
		discards, wantSize int
	}{
		{name: "layered", raw: good, wantSize: 1025},
		{name: "directory root falls back", err: fmt.Errorf("x: %w", orchestrator.ErrUnsupported), fallback: true},
		{name: "overlay root (two stacks) falls back", raw: json.RawMessage(`{"id":"cap-3","layers":[{"path":"/l/base","uuid":"u1"}],"upper":[{"path":"/u/e","uuid":"u3","role":"upper"}],"virtualSize":1073741825}`),
			fallback: true, discards: 1},
		{name: "capture fails", err: errors.New("boom"), wantErr: true},
		{name: "no layers", raw: json.RawMessage(`{"id":"cap-2","layers":[],"virtualSize":1}`), wantErr: true, discards: 1},
		{name: "not JSON", raw: json.RawMessage(`{`), wantErr: true, discards: 1},
	} {
		t.Run(tc.name, func(t *testing.T) {
			fc, fb := &fakeCapturer{raw: tc.raw, err: tc.err}, &fallbackCapturer{}
			c, err := snapshotCapture{sbx: fc, fallback: fb}.Capture(context.Background(), &Session{SandboxID: "sb"}, "/dir", func(string, string) {})
			if (err != nil) != tc.wantErr || fb.called != tc.fallback || len(fc.discarded) != tc.discards {
				t.Fatalf("err %v, fallback %v, discards %d", err, fb.called, len(fc.discarded))
			}
			if tc.wantSize > 0 && (c.Layers == nil || c.Layers.Overlaybd.SizeMB != tc.wantSize || len(c.Layers.Overlaybd.Layers) != 2 ||
				c.Layers.Resources.CPUCount != 2 || captureID(c.Layers.Capture) != "cap-1") {
				t.Errorf("captured %+v", c.Layers)
			}
		})
	}
}
