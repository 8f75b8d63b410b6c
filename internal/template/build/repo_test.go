package build

import (
	"context"
	"io"
	"log/slog"
	"path/filepath"
	"slices"
	"testing"
	"time"

	"github.com/aenv-dev/aenv/internal/repository/posixfs"
	"github.com/aenv-dev/aenv/internal/snapshot"
)

// TestBuildLayeredOnSecondNode: a layered build is published to a shared posix_fs
// repository, and a second node (its own data dir, catalog and backend) syncs it,
// creates sandboxes from it and builds on it in turn.
func TestBuildLayeredOnSecondNode(t *testing.T) {
	ctx := context.Background()
	repo, err := posixfs.Open(filepath.Join(t.TempDir(), "repo"), posixfs.Options{})
	if err != nil {
		t.Fatal(err)
	}
	log := slog.New(slog.NewTextHandler(io.Discard, nil))
	publisher := func(n *realNode, id string) *snapshot.Publisher {
		p, err := snapshot.New(repo, n.cat.Templates(), snapshot.Options{NodeID: id, StateDir: filepath.Join(n.data, "snapshot"),
			RetryBase: 10 * time.Millisecond, Logger: log})
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { p.Close() })
		return p
	}
	a := newNodeAt(t, Config{}, true, 0)
	a.svc.cfg.Publisher = publisher(a, "node-a")
	b := newNodeAt(t, Config{}, true, 1)
	pubB := publisher(b, "node-b")
	b.svc.cfg.Publisher = pubB

	rec := a.build(t, "shared-one", Spec{FromTemplate: "base", Steps: []Step{
		{Type: StepRun, Args: []string{"echo from-a > /home/user/a.txt"}},
		{Type: StepExpose, Args: []string{"9000"}},
	}})
	if rec.Status != StatusReady {
		t.Fatalf("build on a: %s %+v\n%s", rec.Status, rec.Reason, a.logText(rec.ID))
	}
	// Node b sees it once the upload is complete.
	deadline := time.Now().Add(time.Minute)
	for {
		res, err := pubB.Sync(ctx)
		if err != nil {
			t.Fatal(err)
		}
		if slices.Contains(res.Added, rec.TemplateID) {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("node b never synced %s (last sync %+v)", rec.TemplateID, res)
		}
		time.Sleep(100 * time.Millisecond)
	}
	tpl, err := b.svc.Resolve("shared-one")
	if err != nil {
		t.Fatal(err)
	}
	if !tpl.Layered() || tpl.ID != rec.TemplateID {
		t.Fatalf("synced template: %+v", tpl)
	}
	if a, ok := layersArtifact(tpl); !ok || !slices.Equal(a.Image.ExposedPorts, []string{"9000"}) {
		t.Errorf("synced artifact lost the image config: %+v", a)
	}
	sb := b.create(t, "shared-one")
	if got := b.run(t, sb, "cat /home/user/a.txt; whoami"); got != "from-a\nuser" {
		t.Errorf("sandbox on node b: %q", got)
	}
	// A build on node b from the synced template is layered too.
	rec2 := b.build(t, "shared-two", Spec{FromTemplate: "shared-one", Steps: []Step{{Type: StepRun, Args: []string{"echo from-b >> /home/user/a.txt"}}}})
	if rec2.Status != StatusReady {
		t.Fatalf("build on b: %s %+v\n%s", rec2.Status, rec2.Reason, b.logText(rec2.ID))
	}
	tpl2, _ := b.svc.Resolve("shared-two")
	if _, ok := layersArtifact(tpl2); !ok || len(layerPaths(t, tpl2)) != len(layerPaths(t, tpl))+1 {
		t.Fatalf("build on the synced template: %s", tpl2.Artifact)
	}
	sb2 := b.create(t, "shared-two")
	if got := b.run(t, sb2, "cat /home/user/a.txt"); got != "from-a\nfrom-b" {
		t.Errorf("sandbox of the build on b: %q", got)
	}
}
