package build

import (
	"context"
	"os"
	"strings"
	"testing"
	"time"

	"github.com/aenv-dev/aenv/internal/catalog"
)

// TestDeleteCollectsImage: deleting the only template built from an image frees the
// image's import and converted layers, but not while a sandbox of it runs nor while a
// snapshot of such a sandbox names them as lowers.
func TestDeleteCollectsImage(t *testing.T) {
	n := newNode(t, Config{ImageDiskMB: 256, GCGrace: time.Nanosecond}, true)
	ctx := context.Background()
	dir := baseImage(t, n, nil)
	rec := n.build(t, "gc1", Spec{FromImage: "oci:" + dir, Steps: []Step{{Type: StepRun, Args: []string{"echo hi > /tmp/hi"}}}})
	if rec.Status != StatusReady {
		t.Fatalf("build %s: %+v\n%s", rec.Status, rec.Reason, n.logText(rec.ID))
	}
	all, err := n.cat.Templates().List("")
	if err != nil {
		t.Fatal(err)
	}
	var imp catalog.Template
	for _, tp := range all {
		if strings.HasPrefix(tp.ID, "img-") {
			imp = tp
		}
	}
	if !imp.Layered() {
		t.Fatalf("no layered import: %+v", all)
	}
	lowers := layerPaths(t, imp)
	exists := func(want bool, when string) {
		t.Helper()
		for _, p := range lowers {
			if _, err := os.Stat(p); (err == nil) != want {
				t.Errorf("%s: converted layer %s exists=%v, want %v", when, p, err == nil, want)
			}
		}
	}
	sb := n.create(t, "gc1")
	snap, err := n.orch.Snapshot(ctx, sb.ID, "gc-snap")
	if err != nil {
		t.Fatal(err)
	}
	if _, err := n.svc.Delete(ctx, "gc1"); err != nil {
		t.Fatal(err)
	}
	n.svc.CollectGarbage(ctx)
	exists(true, "sandbox and snapshot alive")
	if err := n.orch.Kill(ctx, sb.ID); err != nil {
		t.Fatal(err)
	}
	n.svc.CollectGarbage(ctx)
	exists(true, "snapshot alive")
	if err := n.orch.DeleteTemplate(ctx, snap.SnapshotID); err != nil {
		t.Fatal(err)
	}
	n.svc.CollectGarbage(ctx)
	exists(false, "nothing uses the image")
	if _, err := n.cat.Templates().Get(imp.ID); err == nil {
		t.Errorf("import %s kept", imp.ID)
	}
	if _, err := os.Stat(imp.RootFSDir); !os.IsNotExist(err) {
		t.Errorf("import directory kept: %v", err)
	}
}
