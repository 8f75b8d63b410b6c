package build

import (
	"bufio"
	"context"
	"encoding/json"
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
	if !isLayered(imp) {
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
