package convert

import (
	"encoding/json"
	"reflect"
	"testing"

	"github.com/aenv-dev/aenv/internal/catalog"
	"github.com/aenv-dev/aenv/internal/image"
	"github.com/aenv-dev/aenv/internal/sandbox"
	"github.com/aenv-dev/aenv/internal/storage/stack"
)

// TestArtifactLayers reads the artifacts `aenv pull` registers (image.Artifact with the
// converted stack) the way sandboxes are launched from them, so a format change on
// either side fails here.
func TestArtifactLayers(t *testing.T) {
	res := &Result{SizeMB: 64, Keys: []string{"k0", "k1"}, Layers: []stack.LayerRef{
		{Path: "/d/base.commit", Size: 10, UUID: "u0"}, {Path: "/d/l1.commit", Digest: "sha256:ab", Size: 20}}}
	withLayers, _ := json.Marshal(image.Artifact{Kind: image.ArtifactKind, Overlaybd: res.Stack()})
	dirOnly, _ := json.Marshal(image.Artifact{Kind: image.ArtifactKind})
	want := &catalog.LayerStack{SizeMB: 64, Layers: []sandbox.LayerRef{
		{Path: "/d/base.commit", Size: 10, UUID: "u0"}, {Path: "/d/l1.commit", Digest: "sha256:ab", Size: 20}}}
	for _, tc := range []struct {
		name     string
		artifact []byte
		want     *catalog.LayerStack
	}{
		{"converted", withLayers, want},
		{"not converted", dirOnly, nil},
	} {
		t.Run(tc.name, func(t *testing.T) {
			got, err := catalog.DecodeLayers(tc.artifact)
			if err != nil || !reflect.DeepEqual(got, tc.want) {
				t.Fatalf("DecodeLayers(%s) = %+v, %v; want %+v", tc.artifact, got, err, tc.want)
			}
		})
	}
}
