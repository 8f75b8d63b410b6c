package snapshot

import (
	"encoding/json"
	"errors"
	"slices"
	"strings"
	"testing"

	"github.com/aenv-dev/aenv/internal/catalog"
	"github.com/aenv-dev/aenv/internal/repository"
	"github.com/aenv-dev/aenv/internal/sandbox"
)

var (
	dA = repository.DigestOf([]byte("a"))
	dB = repository.DigestOf([]byte("b"))
	dC = repository.DigestOf([]byte("c"))
)

func TestArtifactLayers(t *testing.T) {
	hexA := strings.Repeat("a", 64)
	for _, tc := range []struct {
		name, art string
		want      []LayerFile
		err       bool
	}{
		{"empty", ``, nil, false},
		{"oci capture", `{"backend":"oci","layers":[{"path":"/l/a.commit","uuid":"U1","size":4096},{"path":"/l/b.commit","uuid":"U2","size":8192}]}`,
			[]LayerFile{{Path: "/l/a.commit", UUID: "U1", Size: 4096}, {Path: "/l/b.commit", UUID: "U2", Size: 8192}}, false},
		{"oci capture of an overlay root: the upper's layers apart, after the lower's", `{"backend":"oci","upper":[{"path":"/u/e.commit","uuid":"E","role":"upper"},{"path":"/l/s.commit","uuid":"S","role":"upper"}],"layers":[{"path":"/t/a","uuid":"A"}]}`,
			[]LayerFile{{Path: "/t/a", UUID: "A"}, {Path: "/u/e.commit", UUID: "E", Role: "upper"}, {Path: "/l/s.commit", UUID: "S", Role: "upper"}}, false},
		{"nested and repeated", `{"overlaybd":{"lowers":[{"path":"/t/x.zfile","uuid":"X"}]},"again":[{"path":"/t/x.zfile","uuid":"X"}]}`,
			[]LayerFile{{Path: "/t/x.zfile", UUID: "X"}}, false},
		{"relative and uuid-less paths are not layers", `{"rootfs":{"path":"rel/a","uuid":"U"},"dir":{"path":"/rootfs"}}`, nil, false},
		{"digest-only (read lazily) between files", `{"layers":[{"digest":"sha256:` + hexA + `","uuid":"L","size":512},{"path":"/l/c.commit","uuid":"C"},{"digest":"sha256:` + hexA + `","uuid":"L"}]}`,
			[]LayerFile{{Digest: repository.Digest("sha256:" + hexA), UUID: "L", Size: 512}, {Path: "/l/c.commit", UUID: "C"}}, false},
		{"bad digest, or a digest without a uuid, is not a layer", `{"layers":[{"digest":"sha256:zz","uuid":"L"},{"digest":"sha256:` + hexA + `"}]}`, nil, false},
		{"microVM memory image: blobs with roles", `{"layers":[{"path":"/c/disk.lsmt","uuid":"D"}],"memory":{"dir":"/c","ram":{"path":"/c/ram","size":4096,"role":"memory"},"state":{"digest":"sha256:` + hexA + `","size":9,"role":"vmstate"}}}`,
			[]LayerFile{{Path: "/c/disk.lsmt", UUID: "D"}, {Path: "/c/ram", Size: 4096, Role: "memory"},
				{Digest: repository.Digest("sha256:" + hexA), Size: 9, Role: "vmstate"}}, false},
		{"blobs after layers, by role", `{"memory":{"state":{"path":"/c/s","role":"vmstate"},"ram":{"path":"/c/r","role":"memory"}},"layers":[{"path":"/c/1","uuid":"1"},{"path":"/c/2","uuid":"2"}]}`,
			[]LayerFile{{Path: "/c/1", UUID: "1"}, {Path: "/c/2", UUID: "2"}, {Path: "/c/r", Role: "memory"}, {Path: "/c/s", Role: "vmstate"}}, false},
		{"role rootfs without a uuid is not a layer", `{"x":{"path":"/c/x","role":"rootfs"}}`, nil, false},
		{"not json", `{"layers":`, nil, true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			got, err := ArtifactLayers(json.RawMessage(tc.art))
			if (err != nil) != tc.err || !slices.Equal(got, tc.want) {
				t.Fatalf("got %+v, %v; want %+v (err %v)", got, err, tc.want, tc.err)
			}
		})
	}
}

// Digests are filled in by path on the publishing node and paths by digest
// on the syncing node; other fields survive exactly.
func TestArtifactRelocation(t *testing.T) {
	art := json.RawMessage(`{"virtualSize":18446744073709551615,"layers":[{"path":"/a/1.commit","uuid":"U1","size":1},{"path":"/a/2.commit","uuid":"U2","size":2}],"other":{"path":"/elsewhere"}}`)
	withD, err := withDigests(art, map[string]repository.Digest{"/a/1.commit": dA, "/a/2.commit": dB})
	if err != nil {
		t.Fatal(err)
	}
	withP, err := withPaths(withD, map[repository.Digest]string{dA: "/b/A.layer", dB: "/b/B.layer"})
	if err != nil {
		t.Fatal(err)
	}
	var got struct {
		VirtualSize uint64 `json:"virtualSize"`
		Layers      []struct {
			Path, UUID, Digest string
			Size               int64
		} `json:"layers"`
		Other map[string]string `json:"other"`
	}
	if err := json.Unmarshal(withP, &got); err != nil {
		t.Fatal(err)
	}
	if got.VirtualSize != 1<<64-1 || len(got.Layers) != 2 || got.Other["path"] != "/elsewhere" {
		t.Fatalf("relocated %s", withP)
	}
	for i, want := range []struct {
		path string
		d    repository.Digest
	}{{"/b/A.layer", dA}, {"/b/B.layer", dB}} {
		if l := got.Layers[i]; l.Path != want.path || l.Digest != string(want.d) || l.Size != int64(i+1) {
			t.Fatalf("layer %d: %+v", i, l)
		}
	}
}

func TestWithLayerList(t *testing.T) {
	art := json.RawMessage(`{"layers":[{"digest":"` + string(dA) + `"},{"digest":"` + string(dB) + `"}],"keep":[{"digest":"` + string(dA) + `"}]}`)
	out, ok, err := withLayerList(art, []repository.Digest{dA, dB}, []layerRef{{Path: "/m", Digest: dC, Size: 3, UUID: "M"}})
	if err != nil || !ok {
		t.Fatalf("withLayerList: %v %v", ok, err)
	}
	var got struct {
		Layers []map[string]any `json:"layers"`
		Keep   []map[string]any `json:"keep"`
	}
	if err := json.Unmarshal(out, &got); err != nil {
		t.Fatal(err)
	}
	if len(got.Layers) != 1 || got.Layers[0]["digest"] != string(dC) || got.Layers[0]["path"] != "/m" || len(got.Keep) != 1 {
		t.Fatalf("rewritten %s", out)
	}
	if _, ok, _ := withLayerList(art, []repository.Digest{dB, dA}, nil); ok {
		t.Fatal("replaced a list in another order")
	}
}

func TestManifestFromTemplate(t *testing.T) {
	tpl := catalog.Template{ID: "snap-x", Kind: catalog.KindSnapshot, Aliases: []string{"golden"},
		Resources: sandbox.Resources{CPUCount: 2, MemoryMB: 512, DiskSizeMB: 1024}, EnvVars: map[string]string{"K": "V"},
		DefaultUser: "user", SourceSandboxID: "sbx-1", ParentID: "snap-p", Backend: "oci", EnvdAccessToken: "tok",
		Artifact: json.RawMessage(`{"layers":[{"path":"/l/a.commit","uuid":"U1","size":4096}]}`)}
	m, err := ManifestFromTemplate(tpl, "0.5.15")
	if err != nil {
		t.Fatal(err)
	}
	if m.ID != "snap-x" || m.Kind != repository.KindSnapshot || m.Name != "golden" || len(m.Layers) != 1 ||
		m.Resources.DiskSizeMB != 1024 || m.SourceSandbox != "sbx-1" || m.ParentSnapshot != "snap-p" ||
		m.Config.EnvVars["K"] != "V" || m.EnvdVersion != "0.5.15" || m.Config.EnvdAccessToken != "tok" || m.validate() != nil {
		t.Fatalf("manifest %+v", m)
	}
	// A microVM snapshot publishes its memory image; a template built from such a
	// capture only its layers (its sandboxes boot the filesystem).
	mem := json.RawMessage(`{"layers":[{"path":"/l/a.commit","uuid":"U1"}],"memory":{"ram":{"path":"/c/ram","size":8,"role":"memory"},"state":{"path":"/c/state","size":4,"role":"vmstate"}}}`)
	tpl.Artifact = mem
	if m, err := ManifestFromTemplate(tpl, ""); err != nil || len(m.Layers) != 3 || m.Layers[1].Role != "memory" || m.Layers[2].Role != "vmstate" {
		t.Fatalf("microVM snapshot: %+v, %v", m.Layers, err)
	}
	built := tpl
	built.Kind = catalog.KindTemplate
	if m, err := ManifestFromTemplate(built, ""); err != nil || len(m.Layers) != 1 || m.Layers[0].Role != "" {
		t.Fatalf("template built on a microVM: %+v, %v", m.Layers, err)
	}
	tpl.Artifact = json.RawMessage(`{"rootfsDir":"/srv/rootfs"}`)
	if _, err := ManifestFromTemplate(tpl, ""); !errors.Is(err, ErrInvalid) {
		t.Fatalf("directory template: %v", err)
	}
}
