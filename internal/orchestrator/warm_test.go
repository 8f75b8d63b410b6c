package orchestrator

import (
	"context"
	"encoding/json"
	"testing"

	"github.com/aenv-dev/aenv/internal/catalog"
	"github.com/aenv-dev/aenv/internal/sandbox"
	"github.com/aenv-dev/aenv/internal/sandbox/mock"
)

// forgettingBackend records the roots whose warm containers the orchestrator drops.
type forgettingBackend struct {
	*mock.Backend
	forgot []sandbox.RootFS
}

func (f *forgettingBackend) ForgetTemplate(_ context.Context, root sandbox.RootFS) error {
	f.forgot = append(f.forgot, root)
	return nil
}

// TestForgetWarm: a removed template's root (as sandboxes are created on it: its layered
// stack where it has one, else its directory) is handed to the backend so its warm
// containers stop; snapshots have none; a root that cannot be derived any more still
// reaches the backend, which drops the warm roots whose files are gone.
func TestForgetWarm(t *testing.T) {
	ctx := context.Background()
	h := newHarness(t, mock.Options{}, nil)
	var fb *forgettingBackend
	h.wrap = func(b *mock.Backend) sandbox.Backend {
		fb = &forgettingBackend{Backend: b}
		return fb
	}
	h.restart()
	const layeredArt = `{"overlaybd":{"sizeMB":1024,"layers":[{"path":"/data/l1.zfile"}]}}`
	layered := sandbox.RootFS{LowerDir: "/data/templates/lay/rootfs", Layers: []sandbox.LayerRef{{Path: "/data/l1.zfile"}}, VirtualSize: 1 << 30}

	h.o.DiscardTemplate(ctx, catalog.Template{ID: "lay", Kind: catalog.KindTemplate, RootFSDir: "/data/templates/lay/rootfs",
		Artifact: json.RawMessage(layeredArt)})
	h.o.ForgetWarm(ctx, catalog.Template{ID: "dir", Kind: catalog.KindTemplate, RootFSDir: "/data/templates/dir/rootfs"})
	h.o.ForgetWarm(ctx, catalog.Template{ID: "gone", Kind: catalog.KindTemplate, RootFSDir: "/x", Artifact: json.RawMessage(`{"overlaybd":"broken"}`)})
	h.o.ForgetWarm(ctx, catalog.Template{ID: "snap", Kind: catalog.KindSnapshot})
	want := []sandbox.RootFS{layered, {LowerDir: "/data/templates/dir/rootfs"}, {LowerDir: "/x"}}
	if len(fb.forgot) != len(want) {
		t.Fatalf("forgot %+v, want %+v", fb.forgot, want)
	}
	for i := range want {
		if fb.forgot[i].LowerDir != want[i].LowerDir || len(fb.forgot[i].Layers) != len(want[i].Layers) {
			t.Errorf("forgot[%d] = %+v, want %+v", i, fb.forgot[i], want[i])
		}
	}
}
