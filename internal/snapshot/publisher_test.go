package snapshot

import (
	"bytes"
	"context"
	"errors"
	"os"
	"path/filepath"
	"slices"
	"testing"

	"github.com/aenv-dev/aenv/internal/catalog"
	"github.com/aenv-dev/aenv/internal/repository"
)

// Publishing to each backend: the record becomes complete, names every
// layer by the sha256 of its file, and the blobs hold the files' bytes.
func TestPublish(t *testing.T) {
	for _, b := range backends() {
		t.Run(b.name, func(t *testing.T) {
			ctx := context.Background()
			n := newNode(t, "node-a", b.open(t), Options{})
			files, _ := stackLayers(t, t.TempDir(), 3, 1)
			h, err := n.pub.Publish(ctx, testManifest(t, "snap-1", files))
			if err != nil {
				t.Fatal(err)
			}
			if err := h.Wait(ctx); err != nil {
				t.Fatal(err)
			}
			if st := h.Status(); st.State != StateComplete || st.Blobs != 3 || st.Uploaded != 3 {
				t.Fatalf("status %+v", st)
			}
			rec, err := n.remote.GetRecord(ctx, repository.KindSnapshot, "snap-1")
			if err != nil {
				t.Fatal(err)
			}
			if rec.State != repository.StateComplete || len(rec.Layers) != 3 || rec.SourceSandboxID != "sbx-snap-1" {
				t.Fatalf("record %+v", rec)
			}
			for i, l := range rec.Layers {
				want, _ := os.ReadFile(files[i].Path)
				if l.Digest != repository.DigestOf(want) || l.UUID != files[i].UUID || l.Role != "rootfs" {
					t.Fatalf("layer %d: %+v", i, l)
				}
				got, err := repository.ReadAll(ctx, n.remote, l.Digest)
				if err != nil || !bytes.Equal(got, want) {
					t.Fatalf("blob %d: %v", i, err)
				}
				// Its block hash list is published and referenced.
				bh, err := repository.ReadBlockHashes(ctx, n.remote, l.BlockHashes, l.Size)
				if err != nil {
					t.Fatalf("layer %d block hash list %q: %v", i, l.BlockHashes, err)
				}
				if wantH, _ := repository.ComputeBlockHashes(bytes.NewReader(want), repository.DefaultBlockHashChunk); bh.Digest() != wantH.Digest() {
					t.Fatalf("layer %d: block hash list does not describe the layer", i)
				}
			}
			if _, err := os.Stat(n.pub.path("publishing", "snap-1.json")); !errors.Is(err, os.ErrNotExist) {
				t.Fatalf("journal left after completion: %v", err)
			}
			if slices.Contains(n.cache.PinOwners(), pinOwner("snap-1")) {
				t.Fatal("publication pin left after completion")
			}
			st, err := n.pub.Status(ctx, "snap-1")
			if err != nil || st.State != StateComplete {
				t.Fatalf("Status = %+v, %v", st, err)
			}
		})
	}
}

// Bad manifests are refused before anything is written.
func TestPublishRejects(t *testing.T) {
	n := newNode(t, "node-a", posixBackend().open(t), Options{})
	files, _ := stackLayers(t, t.TempDir(), 1, 2)
	for _, tc := range []struct {
		name string
		edit func(m *Manifest)
	}{
		{"bad id", func(m *Manifest) { m.ID = "../x" }},
		{"bad kind", func(m *Manifest) { m.Kind = "volume" }},
		{"bad name", func(m *Manifest) { m.Name = "a/b" }},
		{"no layers", func(m *Manifest) { m.Layers = nil }},
		{"relative path", func(m *Manifest) { m.Layers = []LayerFile{{Path: "layer.commit"}} }},
		{"artifact not json", func(m *Manifest) { m.Config.Artifact = []byte("{") }},
	} {
		t.Run(tc.name, func(t *testing.T) {
			m := testManifest(t, "snap-bad", files)
			tc.edit(&m)
			if _, err := n.pub.Publish(context.Background(), m); !errors.Is(err, ErrInvalid) {
				t.Fatalf("err = %v, want ErrInvalid", err)
			}
			if ents, _ := os.ReadDir(n.pub.path("publishing")); len(ents) != 0 {
				t.Fatalf("journal written for a bad manifest")
			}
		})
	}
	// A layer file that does not exist fails the publication for good.
	m := testManifest(t, "snap-missing", []LayerFile{{Path: filepath.Join(t.TempDir(), "gone.commit")}})
	h, err := n.pub.Publish(context.Background(), m)
	if err != nil {
		t.Fatal(err)
	}
	if err := h.Wait(context.Background()); !errors.Is(err, os.ErrNotExist) || h.Status().State != StateFailed {
		t.Fatalf("Wait = %v, status %+v", err, h.Status())
	}
	if n.pub.journaled("snap-missing") {
		t.Fatal("journal of a permanently failed publication kept")
	}
}

// While the upload is held, the snapshot is already in this node's cache
// (usable here), its record is pending, and another node's sync ignores
// it; once the upload completes the other node registers it, with its
// layers fetched and the artifact pointing at them.
func TestUsableLocallyBeforeUploadAndSyncOnlyWhenComplete(t *testing.T) {
	for _, b := range backends() {
		t.Run(b.name, func(t *testing.T) {
			ctx := context.Background()
			remote := b.open(t)
			g := newGated(remote)
			a := newNode(t, "node-a", g, Options{})
			nb := newNode(t, "node-b", remote, Options{})
			files, model := stackLayers(t, t.TempDir(), 2, 3)
			m := testManifest(t, "snap-1", files)
			m.Name = "golden"
			h, err := a.pub.Publish(ctx, m)
			if err != nil {
				t.Fatal(err)
			}
			d := <-g.puts // the upload has started and is held
			if !a.cache.Cached(d) {
				t.Fatalf("layer %s not in node A's cache before its upload", d)
			}
			br, err := a.cache.OpenBlob(ctx, d)
			if err != nil {
				t.Fatal(err)
			}
			buf := make([]byte, 4096)
			if _, err := br.ReadAt(ctx, buf, 0); err != nil {
				t.Fatal(err)
			}
			br.Close()
			if st := h.Status(); st.State != StatePending {
				t.Fatalf("status %+v while uploading", st)
			}
			rec, err := remote.GetRecord(ctx, repository.KindSnapshot, "snap-1")
			if err != nil || rec.State != repository.StatePending {
				t.Fatalf("record %+v, %v", rec, err)
			}
			if res, err := nb.pub.Sync(ctx); err != nil || len(res.Added) != 0 {
				t.Fatalf("node B synced a pending record: %+v %v", res, err)
			}
			if _, err := nb.cat.Templates().Get("snap-1"); !errors.Is(err, catalog.ErrNotFound) {
				t.Fatalf("node B catalog has the pending snapshot: %v", err)
			}

			g.open()
			if err := h.Wait(ctx); err != nil {
				t.Fatal(err)
			}
			res, err := nb.pub.Sync(ctx)
			if err != nil || !slices.Equal(res.Added, []string{"snap-1"}) {
				t.Fatalf("sync after completion: %+v %v", res, err)
			}
			tpl, err := nb.cat.Templates().Resolve("golden")
			if err != nil {
				t.Fatal(err)
			}
			if tpl.Kind != catalog.KindSnapshot || tpl.EnvVars["A"] != "1" || tpl.DefaultUser != "user" ||
				tpl.Resources.MemoryMB != 256 || tpl.SourceSandboxID != "sbx-snap-1" || tpl.Backend != "oci" {
				t.Fatalf("node B template %+v", tpl)
			}
			arts, err := ArtifactLayers(tpl.Artifact)
			if err != nil || len(arts) != 2 {
				t.Fatalf("artifact layers %+v %v", arts, err)
			}
			for _, l := range arts {
				if filepath.Dir(l.Path) != nb.pub.path("layers") {
					t.Fatalf("node B artifact points at %s, not its own copy", l.Path)
				}
			}
			if got := readStack(t, tpl.Artifact); !bytes.Equal(got, model) {
				t.Fatal("node B's copy of the stack differs from node A's")
			}
			// A second sync changes nothing.
			if res, err := nb.pub.Sync(ctx); err != nil || len(res.Added)+len(res.Updated)+len(res.Removed) != 0 {
				t.Fatalf("second sync %+v %v", res, err)
			}
			// Node A (which has its own catalog entry) does not fetch its own layers.
			if res, err := a.pub.Sync(ctx); err != nil || len(res.Added) != 0 {
				t.Fatalf("node A sync %+v %v", res, err)
			}
		})
	}
}

// A node stopped mid-upload finishes the publication when it starts again.
func TestRestartResumesPendingPublication(t *testing.T) {
	ctx := context.Background()
	remote := posixBackend().open(t)
	g := newGated(remote)
	n := newNode(t, "node-a", g, Options{})
	files, _ := stackLayers(t, t.TempDir(), 2, 4)
	h, err := n.pub.Publish(ctx, testManifest(t, "snap-r", files))
	if err != nil {
		t.Fatal(err)
	}
	<-g.puts
	n.pub.Close() // the node stops; the upload is cancelled
	if err := h.Wait(ctx); err == nil {
		t.Fatal("publication completed although its upload was held")
	}
	rec, err := remote.GetRecord(ctx, repository.KindSnapshot, "snap-r")
	if err != nil || rec.State != repository.StatePending {
		t.Fatalf("record after stop %+v %v", rec, err)
	}
	if !n.pub.journaled("snap-r") {
		t.Fatal("journal lost on stop")
	}
	// The layer files are deleted meanwhile (the backend discarded them):
	// the cached copies are enough.
	for _, f := range files {
		os.Remove(f.Path)
	}

	n.open(t, remote) // restart, repository reachable
	if err := n.pub.Start(ctx, nil); err != nil {
		t.Fatal(err)
	}
	waitFor(t, "resumed publication", func() bool {
		st, err := n.pub.Status(ctx, "snap-r")
		return err == nil && st.State != StatePending
	})
	st, _ := n.pub.Status(ctx, "snap-r")
	if st.State != StateComplete {
		t.Fatalf("resumed publication: %+v", st)
	}
	rec, err = remote.GetRecord(ctx, repository.KindSnapshot, "snap-r")
	if err != nil || rec.State != repository.StateComplete || rec.Revision != 2 {
		t.Fatalf("record after resume %+v %v", rec, err)
	}
	for _, l := range rec.Layers {
		if _, err := remote.StatBlob(ctx, l.Digest); err != nil {
			t.Fatalf("blob %s: %v", l.Digest, err)
		}
	}
}

// A child snapshot uploads only its new layer: the ones it shares with its
// parent are already in the repository.
func TestPublishDeduplicates(t *testing.T) {
	n := newNode(t, "node-a", posixBackend().open(t), Options{})
	files, _ := stackLayers(t, t.TempDir(), 3, 12)
	publishWait(t, n, testManifest(t, "snap-parent", files[:2]))
	// Each layer goes with its block hash list.
	if got := n.cache.Stats().PublishedBlobs; got != 2*2 {
		t.Fatalf("parent published %d blobs", got)
	}
	publishWait(t, n, testManifest(t, "snap-child", files))
	if got := n.cache.Stats().PublishedBlobs; got != 3*2 {
		t.Fatalf("parent and child published %d blobs, want 6", got)
	}
}
