package snapshot

import (
	"bytes"
	"context"
	"encoding/json"
	"io"
	"os"
	"slices"
	"strings"
	"testing"

	"github.com/aenv-dev/aenv/internal/catalog"
	"github.com/aenv-dev/aenv/internal/repository"
	"github.com/aenv-dev/aenv/internal/repository/layers"
	"github.com/aenv-dev/aenv/internal/repository/repositorytest"
	"github.com/aenv-dev/aenv/internal/storage/cache"
	"github.com/aenv-dev/aenv/internal/storage/stack"
)

// artifactRefs decodes the layer refs of a capture-shaped artifact.
func artifactRefs(t testing.TB, art json.RawMessage) []stack.LayerRef {
	t.Helper()
	var a struct {
		Layers []stack.LayerRef `json:"layers"`
	}
	if err := json.Unmarshal(art, &a); err != nil {
		t.Fatal(err)
	}
	return a.Layers
}

// readLazy reads the whole device of refs through a resolver.
func readLazy(t testing.TB, refs []stack.LayerRef, r stack.Resolver) []byte {
	t.Helper()
	s, err := stack.Open(context.Background(), &stack.Manifest{Lowers: refs}, stack.Options{Resolver: r})
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	b := make([]byte, s.Size())
	if _, err := s.ReadAt(b, 0); err != nil && err != io.EOF {
		t.Fatal(err)
	}
	return b
}

// With LazyLayers, a node that syncs a record downloads nothing: the entry's
// layer refs are digest-only (the publishing node's paths dropped), and the
// stack reads correctly through a resolver over the repository. A snapshot
// taken there on top of those layers publishes only its own new layer, its
// record names every layer (so GC keeps the shared ones), and a third node
// reads the whole stack lazily too. Pins of a sandbox on the lazy entry cover
// every layer.
func TestLazySync(t *testing.T) {
	for _, b := range backends() {
		t.Run(b.name, func(t *testing.T) {
			ctx := context.Background()
			remote := b.open(t)
			a := newNode(t, "node-a", remote, Options{})
			nb := newNode(t, "node-b", remote, Options{LazyLayers: true})
			nc := newNode(t, "node-c", remote, Options{LazyLayers: true})
			files, model := stackLayers(t, t.TempDir(), 3, 7)
			h, err := a.pub.Publish(ctx, testManifest(t, "snap-base", files))
			if err != nil {
				t.Fatal(err)
			}
			if err := h.Wait(ctx); err != nil {
				t.Fatal(err)
			}

			res, err := nb.pub.Sync(ctx)
			if err != nil || !slices.Equal(res.Added, []string{"snap-base"}) {
				t.Fatalf("sync: %+v %v", res, err)
			}
			tpl, err := nb.cat.Templates().Get("snap-base")
			if err != nil {
				t.Fatal(err)
			}
			refs := artifactRefs(t, tpl.Artifact)
			if len(refs) != len(files) {
				t.Fatalf("synced artifact has %d layers, want %d", len(refs), len(files))
			}
			for _, r := range refs {
				if r.Path != "" || repository.Digest(r.Digest).Validate() != nil || r.UUID == "" {
					t.Fatalf("synced layer ref %+v: want a digest and a uuid, no path", r)
				}
			}
			if ents, _ := os.ReadDir(nb.pub.path("layers")); len(ents) != 0 {
				t.Fatalf("lazy sync wrote %d layer files", len(ents))
			}
			if st := nb.cache.Stats(); st.Fetches != 0 || st.FetchedBytes != 0 {
				t.Fatalf("lazy sync fetched blobs into the node cache: %+v", st)
			}

			bc, err := cache.Open(cache.Options{Dir: t.TempDir(), MaxBytes: 64 << 20, BlockSize: 64 << 10})
			if err != nil {
				t.Fatal(err)
			}
			defer bc.Close()
			// The sync learnt each layer's block hash list: B's reads are verified.
			for _, r := range refs {
				if h, err := nb.pub.HashIndex().BlockHashes(ctx, repository.Digest(r.Digest)); h == nil || err != nil {
					t.Fatalf("no block hash list for synced layer %s: %v", r.Digest, err)
				}
			}
			res0 := &layers.Resolver{Repo: nb.cache, Cache: bc, Remote: remote, Hashes: nb.pub.HashIndex()}
			if got := readLazy(t, refs, res0); !bytes.Equal(got, model) {
				t.Fatal("node B reads other bytes than node A wrote")
			}
			if res0.FetchedBytes() == 0 || bc.Stats().FetchedBytes == 0 {
				t.Fatalf("nothing read from the repository: resolver %d, cache %+v", res0.FetchedBytes(), bc.Stats())
			}

			if err := nb.pub.PinSandbox("sbx-lazy", "snap-base"); err != nil {
				t.Fatal(err)
			}
			var want []repository.Digest
			for _, r := range refs {
				want = append(want, repository.Digest(r.Digest))
			}
			slices.Sort(want)
			if got := nb.cache.Pinned(); !slices.Equal(got, slices.Compact(want)) {
				t.Fatalf("pins %v, want %v", got, want)
			}

			// A snapshot on node B: the lazy layers plus one sealed here.
			top, topModel := stackLayers(t, t.TempDir(), 1, 8)
			snapRefs := append(slices.Clone(refs), stack.LayerRef{Path: top[0].Path, Size: top[0].Size, UUID: top[0].UUID})
			art, err := json.Marshal(map[string]any{"version": 1, "backend": "oci", "layers": snapRefs, "virtualSize": testVSize})
			if err != nil {
				t.Fatal(err)
			}
			m, err := ManifestFromTemplate(catalog.Template{ID: "snap-b", Kind: catalog.KindSnapshot, Artifact: art}, "0.5.15")
			if err != nil {
				t.Fatal(err)
			}
			if len(m.Layers) != len(snapRefs) || m.Layers[0].Path != "" || m.Layers[0].Digest == "" {
				t.Fatalf("manifest layers %+v", m.Layers)
			}
			hb, err := nb.pub.Publish(ctx, m)
			if err != nil {
				t.Fatal(err)
			}
			if err := hb.Wait(ctx); err != nil {
				t.Fatal(err)
			}
			if st := hb.Status(); st.Blobs != len(files)+1 {
				t.Fatalf("publication status %+v", st)
			}
			rec, err := remote.GetRecord(ctx, repository.KindSnapshot, "snap-b")
			if err != nil {
				t.Fatal(err)
			}
			if got := rec.Digests(); len(got) != len(files)+1 || !slices.Contains(got, want[0]) {
				t.Fatalf("record of the lazy snapshot names %v", got)
			}
			for i, l := range rec.Layers {
				// Lazily read layers keep the list their record named.
				if l.BlockHashes == "" {
					t.Fatalf("layer %d of the lazy snapshot names no block hash list", i)
				}
			}

			if _, err := nc.pub.Sync(ctx); err != nil {
				t.Fatal(err)
			}
			tc, err := nc.cat.Templates().Get("snap-b")
			if err != nil {
				t.Fatal(err)
			}
			got := readLazy(t, artifactRefs(t, tc.Artifact), &layers.Resolver{Repo: nc.cache, Remote: remote, Hashes: nc.pub.HashIndex()})
			// The top layer's writes land over the base model.
			wantDev := slices.Clone(model)
			for off := 0; off < len(topModel); off += 4096 {
				if blk := topModel[off : off+4096]; !bytes.Equal(blk, make([]byte, 4096)) {
					copy(wantDev[off:], blk)
				}
			}
			if !bytes.Equal(got, wantDev) {
				t.Fatal("node C reads node B's snapshot wrong")
			}
		})
	}
}

// A digest-only layer that is not in the repository cannot be published:
// this node has no bytes to upload.
func TestLazyPublishMissingLayer(t *testing.T) {
	ctx := context.Background()
	remote := posixBackend().open(t)
	n := newNode(t, "node-a", remote, Options{LazyLayers: true})
	_, missing := repositorytest.Blob(99, 4096)
	m := Manifest{ID: "snap-gone", Kind: repository.KindSnapshot, Layers: []LayerFile{{Digest: missing, UUID: "U"}}}
	h, err := n.pub.Publish(ctx, m)
	if err != nil {
		t.Fatal(err)
	}
	if err := h.Wait(ctx); err == nil {
		t.Fatal("published a snapshot naming a layer nobody has")
	}
	if _, err := remote.GetRecord(ctx, repository.KindSnapshot, "snap-gone"); err == nil {
		t.Fatal("record written for a snapshot with a missing layer")
	}
	bad := Manifest{ID: "snap-bad", Kind: repository.KindSnapshot, Layers: []LayerFile{{Digest: "sha256:xyz"}}}
	if _, err := n.pub.Publish(ctx, bad); err == nil {
		t.Fatal("accepted a malformed digest")
	}
}

// withLazyPaths rewrites only the refs of the record's layers: to this node's file
// where it has one, else digest-only; other objects with a digest stay as they are.
func TestWithLazyPaths(t *testing.T) {
	dA, dB, other := "sha256:"+strings.Repeat("a", 64), "sha256:"+strings.Repeat("b", 64), "sha256:"+strings.Repeat("c", 64)
	in := `{"overlaybd":{"layers":[{"path":"/nodeA/a.zfile","digest":"` + dA + `","uuid":"A"},{"path":"/nodeA/b.commit","digest":"` + dB + `","uuid":"B","size":7}]},` +
		`"image":{"digest":"` + other + `","path":"/src/layout"}}`
	local := map[repository.Digest]string{repository.Digest(dA): "/here/a.layer", repository.Digest(dB): ""}
	out, err := withLazyPaths(json.RawMessage(in), local)
	if err != nil {
		t.Fatal(err)
	}
	var got struct {
		Overlaybd struct {
			Layers []map[string]any `json:"layers"`
		} `json:"overlaybd"`
		Image map[string]any `json:"image"`
	}
	if err := json.Unmarshal(out, &got); err != nil {
		t.Fatal(err)
	}
	ls := got.Overlaybd.Layers
	if len(ls) != 2 || ls[0]["path"] != "/here/a.layer" || ls[0]["digest"] != dA {
		t.Fatalf("layer with a local file: %v", ls)
	}
	if _, has := ls[1]["path"]; has || ls[1]["digest"] != dB || ls[1]["uuid"] != "B" || ls[1]["size"] != 7.0 {
		t.Fatalf("lazy layer: %v", ls[1])
	}
	if got.Image["path"] != "/src/layout" || got.Image["digest"] != other {
		t.Fatalf("non-layer object changed: %v", got.Image)
	}
	if _, err := withLazyPaths(json.RawMessage(`{"layers":`), local); err == nil {
		t.Fatal("accepted an artifact that is not JSON")
	}
}
