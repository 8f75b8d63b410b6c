package catalog

import (
	"encoding/json"
	"reflect"
	"strings"
	"testing"

	"github.com/aenv-dev/aenv/internal/sandbox"
)

func TestDecodeLayers(t *testing.T) {
	for _, tc := range []struct {
		name     string
		artifact string
		want     *LayerStack
		err      string
	}{
		{"none", ``, nil, ""},
		{"directory template's image config", `{"kind":"image","config":{"user":"root"}}`, nil, ""},
		{"empty stack", `{"overlaybd":{"sizeMB":64,"layers":[]}}`, nil, ""},
		{"snapshot capture", `{"id":"c1","layers":[{"path":"/l"}],"virtualSize":1}`, nil, ""},
		{"layered", `{"kind":"layered","key":"k","overlaybd":{"sizeMB":64,"layers":[{"path":"/a","digest":"sha256:00","size":9,"uuid":"u"},{"digest":"sha256:11"}]}}`,
			&LayerStack{SizeMB: 64, Layers: []sandbox.LayerRef{{Path: "/a", Digest: "sha256:00", Size: 9, UUID: "u"}, {Digest: "sha256:11"}}}, ""},
		{"malformed", `{"overlaybd":{"layers":7}}`, nil, "template artifact"},
		{"not json", `{`, nil, "template artifact"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			tpl := Template{ID: "t", Kind: KindTemplate, Artifact: json.RawMessage(tc.artifact)}
			got, err := tpl.Layers()
			if tc.err != "" {
				if err == nil || !strings.Contains(err.Error(), tc.err) || tpl.Layered() {
					t.Fatalf("Layers = %+v, %v; want error %q", got, err, tc.err)
				}
				return
			}
			if err != nil || !reflect.DeepEqual(got, tc.want) || tpl.Layered() != (tc.want != nil) {
				t.Fatalf("Layers = %+v, %v; want %+v", got, err, tc.want)
			}
		})
	}
}

func TestLayerStackRootFS(t *testing.T) {
	ls := &LayerStack{SizeMB: 3, Layers: []sandbox.LayerRef{{Path: "/a"}}}
	if got := ls.RootFS(); got.LowerDir != "" || len(got.Layers) != 1 || got.VirtualSize != 3<<20 {
		t.Fatalf("RootFS = %+v", got)
	}
	if got := (&LayerStack{Layers: ls.Layers}).RootFS(); got.VirtualSize != 0 {
		t.Fatalf("RootFS without a size = %+v (0: the top layer's)", got)
	}
}
