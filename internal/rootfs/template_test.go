package rootfs

import (
	"encoding/json"
	"testing"

	"github.com/aenv-dev/aenv/internal/image"
	"github.com/aenv-dev/aenv/internal/image/convert"
	"github.com/aenv-dev/aenv/internal/sandbox"
	"github.com/aenv-dev/aenv/internal/storage/stack"
)

// TestTemplateRootFS reads the artifacts `aenv pull` registers (image.Artifact with the
// converted stack as convert.Result), so a format change on either side fails here.
func TestTemplateRootFS(t *testing.T) {
	conv, err := json.Marshal(&convert.Result{SizeMB: 64, Layers: []stack.LayerRef{
		{Path: "/d/base.commit", Size: 10, UUID: "u0"}, {Path: "/d/l1.commit", Digest: "sha256:ab", Size: 20}}})
	if err != nil {
		t.Fatal(err)
	}
	withLayers, _ := json.Marshal(image.Artifact{Kind: image.ArtifactKind, Overlaybd: conv})
	dirOnly, _ := json.Marshal(image.Artifact{Kind: image.ArtifactKind})
	tests := []struct {
		name     string
		artifact string
		want     sandbox.RootFS
		wantErr  bool
	}{
		{"converted", string(withLayers), sandbox.RootFS{LowerDir: "/t/rootfs", VirtualSize: 64 << 20, Layers: []sandbox.LayerRef{
			{Path: "/d/base.commit", Size: 10, UUID: "u0"}, {Path: "/d/l1.commit", Digest: "sha256:ab", Size: 20}}}, false},
		{"not converted", string(dirOnly), sandbox.RootFS{LowerDir: "/t/rootfs"}, false},
		{"no artifact", "", sandbox.RootFS{LowerDir: "/t/rootfs"}, false},
		{"other artifact", `{"kind":"something"}`, sandbox.RootFS{LowerDir: "/t/rootfs"}, false},
		{"garbage", `[1,2`, sandbox.RootFS{LowerDir: "/t/rootfs"}, true},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			got, err := TemplateRootFS("/t/rootfs", json.RawMessage(tc.artifact))
			if (err != nil) != tc.wantErr {
				t.Fatalf("err %v", err)
			}
			g, _ := json.Marshal(got)
			w, _ := json.Marshal(tc.want)
			if string(g) != string(w) {
				t.Fatalf("got %s, want %s", g, w)
			}
		})
	}
}
