package snapshot

import (
	"bytes"
	"context"
	"errors"
	"os"
	"slices"
	"sync"
	"testing"

	"github.com/aenv-dev/aenv/internal/catalog"
	"github.com/aenv-dev/aenv/internal/repository"
)

func publishWait(t *testing.T, n *node, m Manifest) {
	t.Helper()
	h, err := n.pub.Publish(context.Background(), m)
	if err != nil {
		t.Fatal(err)
	}
	if err := h.Wait(context.Background()); err != nil {
		t.Fatal(err)
	}
}

func digestsOfFiles(t *testing.T, files ...LayerFile) []repository.Digest {
	var out []repository.Digest
	for _, f := range files {
		b, err := os.ReadFile(f.Path)
		if err != nil {
			t.Fatal(err)
		}
		// A layer is published with its block hash list.
		h, err := repository.ComputeBlockHashes(bytes.NewReader(b), repository.DefaultBlockHashChunk)
		if err != nil {
			t.Fatal(err)
		}
		out = append(out, repository.DigestOf(b), h.Digest())
	}
	slices.Sort(out)
	return out
}

func sortedDigests(ds []repository.Digest) []repository.Digest {
	ds = slices.Clone(ds)
	slices.Sort(ds)
	return ds
}

// A parent snapshot deleted while its child exists frees nothing (the child
// names every shared layer); a node still running a sandbox on a deleted
// snapshot keeps its entry until the sandbox ends; pinned layers survive
// GC until unpinned; deleting the last record frees the rest.
func TestDeleteLineageAndGC(t *testing.T) {
	for _, b := range backends() {
		t.Run(b.name, func(t *testing.T) {
			ctx := context.Background()
			remote := b.open(t)
			var mu sync.Mutex
			inUse := map[string]bool{}
			a := newNode(t, "node-a", remote, Options{})
			nb := newNode(t, "node-b", remote, Options{InUse: func(id string) bool {
				mu.Lock()
				defer mu.Unlock()
				return inUse[id]
			}})
			var removed []string
			nb.pub.o.OnRemoved = func(_ context.Context, tpl catalog.Template) { removed = append(removed, tpl.ID) }

			chain, _ := stackLayers(t, t.TempDir(), 3, 5)
			other, _ := stackLayers(t, t.TempDir(), 1, 6)
			publishWait(t, a, testManifest(t, "snap-parent", chain[:2]))
			child := testManifest(t, "snap-child", chain)
			child.ParentSnapshot = "snap-parent"
			publishWait(t, a, child)
			publishWait(t, a, testManifest(t, "snap-pinned", other))
			if res, err := nb.pub.Sync(ctx); err != nil || len(res.Added) != 3 {
				t.Fatalf("node B sync: %+v %v", res, err)
			}

			mu.Lock()
			inUse["snap-parent"] = true
			mu.Unlock()
			res, err := a.pub.Delete(ctx, "snap-parent")
			if err != nil || len(res.Deleted) != 0 {
				t.Fatalf("delete parent: freed %v, %v", res.Deleted, err)
			}
			if _, err := remote.GetRecord(ctx, repository.KindSnapshot, "snap-parent"); !errors.Is(err, repository.ErrNotFound) {
				t.Fatalf("parent record: %v", err)
			}
			sr, err := nb.pub.Sync(ctx)
			if err != nil || !slices.Equal(sr.Deferred, []string{"snap-parent"}) {
				t.Fatalf("sync while in use: %+v %v", sr, err)
			}
			if _, err := nb.cat.Templates().Get("snap-parent"); err != nil {
				t.Fatalf("entry in use removed: %v", err)
			}
			mu.Lock()
			inUse["snap-parent"] = false
			mu.Unlock()
			sr, err = nb.pub.Sync(ctx)
			if err != nil || !slices.Equal(sr.Removed, []string{"snap-parent"}) || !slices.Equal(removed, []string{"snap-parent"}) {
				t.Fatalf("sync once free: %+v %v (OnRemoved %v)", sr, err, removed)
			}
			if _, err := nb.cat.Templates().Get("snap-parent"); !errors.Is(err, catalog.ErrNotFound) {
				t.Fatalf("parent entry on node B: %v", err)
			}
			// The child still runs from node B's copies of the shared layers.
			tpl, err := nb.cat.Templates().Get("snap-child")
			if err != nil {
				t.Fatal(err)
			}
			for _, l := range mustLayers(t, tpl) {
				if _, err := os.Stat(l.Path); err != nil {
					t.Fatalf("child layer on node B: %v", err)
				}
			}

			if err := a.pub.PinSandbox("sbx-1", "snap-pinned"); err != nil {
				t.Fatal(err)
			}
			if res, err := a.pub.Delete(ctx, "snap-pinned"); err != nil || len(res.Deleted) != 0 {
				t.Fatalf("delete pinned: freed %v, %v", res.Deleted, err)
			}
			if err := a.pub.UnpinSandbox("sbx-1"); err != nil {
				t.Fatal(err)
			}
			res, err = a.pub.GC(ctx)
			if err != nil || !slices.Equal(sortedDigests(res.Deleted), digestsOfFiles(t, other...)) {
				t.Fatalf("gc after unpin freed %v, %v", res.Deleted, err)
			}

			res, err = a.pub.Delete(ctx, "snap-child")
			if err != nil || !slices.Equal(sortedDigests(res.Deleted), digestsOfFiles(t, chain...)) {
				t.Fatalf("delete child freed %v, %v", res.Deleted, err)
			}
			if _, err := nb.pub.Sync(ctx); err != nil {
				t.Fatal(err)
			}
			if ents, _ := os.ReadDir(nb.pub.path("layers")); len(ents) != 0 {
				t.Fatalf("node B keeps %d fetched layers after every record is gone", len(ents))
			}
			if _, err := a.pub.Delete(ctx, "snap-child"); !errors.Is(err, ErrNotFound) {
				t.Fatalf("second delete: %v", err)
			}
		})
	}
}

func mustLayers(t *testing.T, tpl catalog.Template) []LayerFile {
	t.Helper()
	ls, err := ArtifactLayers(tpl.Artifact)
	if err != nil || len(ls) == 0 {
		t.Fatalf("artifact layers of %s: %v %v", tpl.ID, ls, err)
	}
	return ls
}

// A stack deeper than MaxDepth is merged into a new record version whose
// device content is unchanged, on this node and on one that syncs it; the
// merged-away layers stay until GC.
func TestCompact(t *testing.T) {
	ctx := context.Background()
	remote := posixBackend().open(t)
	a := newNode(t, "node-a", remote, Options{MaxDepth: 3})
	nb := newNode(t, "node-b", remote, Options{})
	files, model := stackLayers(t, t.TempDir(), 6, 7)
	m := testManifest(t, "snap-deep", files)
	// The orchestrator's own catalog entry, as it registers a snapshot.
	if err := a.cat.Templates().Put(catalog.Template{ID: "snap-deep", Kind: catalog.KindSnapshot, Artifact: m.Config.Artifact}); err != nil {
		t.Fatal(err)
	}
	publishWait(t, a, m)
	before, err := remote.GetRecord(ctx, repository.KindSnapshot, "snap-deep")
	if err != nil {
		t.Fatal(err)
	}

	merged, err := a.pub.Compact(ctx, "snap-deep")
	if err != nil || !merged {
		t.Fatalf("Compact = %v, %v", merged, err)
	}
	after, err := remote.GetRecord(ctx, repository.KindSnapshot, "snap-deep")
	if err != nil {
		t.Fatal(err)
	}
	if len(after.Layers) != 3 || after.Revision != before.Revision+1 || after.State != repository.StateComplete ||
		!slices.Equal(after.Digests()[:2], before.Digests()[:2]) {
		t.Fatalf("record after compaction: %d layers rev %d (was %d)", len(after.Layers), after.Revision, before.Revision)
	}
	for i, l := range after.Layers {
		// The merged layer too is published with its block hash list.
		if _, err := repository.ReadBlockHashes(ctx, remote, l.BlockHashes, l.Size); err != nil {
			t.Fatalf("layer %d after compaction: block hash list %q: %v", i, l.BlockHashes, err)
		}
	}
	tpl, err := a.cat.Templates().Get("snap-deep")
	if err != nil {
		t.Fatal(err)
	}
	if ls := mustLayers(t, tpl); len(ls) != 3 {
		t.Fatalf("node A artifact has %d layers", len(ls))
	}
	if !bytes.Equal(readStack(t, tpl.Artifact), model) {
		t.Fatal("merged stack on node A differs")
	}
	if _, err := nb.pub.Sync(ctx); err != nil {
		t.Fatal(err)
	}
	tb, err := nb.cat.Templates().Get("snap-deep")
	if err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(readStack(t, tb.Artifact), model) {
		t.Fatal("merged stack on node B differs")
	}
	for _, d := range before.Digests()[2:] {
		if _, err := remote.StatBlob(ctx, d); err != nil {
			t.Fatalf("merged-away layer freed before GC: %v", err)
		}
	}
	// The merged-away layers go, with their block hash lists.
	var freed []repository.Digest
	for _, l := range before.Layers[2:] {
		freed = append(freed, l.Digest, l.BlockHashes)
	}
	res, err := a.pub.GC(ctx)
	if err != nil || !slices.Equal(sortedDigests(res.Deleted), sortedDigests(freed)) {
		t.Fatalf("GC freed %v, %v", res.Deleted, err)
	}
	if again, err := a.pub.Compact(ctx, "snap-deep"); err != nil || again {
		t.Fatalf("second Compact = %v, %v", again, err)
	}
}

func TestMergeCount(t *testing.T) {
	for _, tc := range []struct{ depth, max, want int }{
		{0, 32, 0}, {32, 32, 0}, {33, 32, 2}, {40, 32, 9}, {5, 3, 3}, {5, 0, 0},
	} {
		if got := MergeCount(tc.depth, tc.max); got != tc.want {
			t.Errorf("MergeCount(%d, %d) = %d, want %d", tc.depth, tc.max, got, tc.want)
		}
	}
}
