package snapshot

import (
	"context"
	"slices"
	"testing"
	"time"

	"github.com/aenv-dev/aenv/internal/catalog"
	"github.com/aenv-dev/aenv/internal/repository/posixfs"
)

// Two nodes name a snapshot alike before either has seen the other's. After syncing,
// every node (the two and a third) resolves the name to the older snapshot and reaches
// the younger by id: the younger's own node hands the name over.
func TestSameNameOnTwoNodes(t *testing.T) {
	ctx := context.Background()
	remote, err := posixfs.Open(t.TempDir(), posixfs.Options{})
	if err != nil {
		t.Fatal(err)
	}
	a := newNode(t, "node-a", remote, Options{})
	b := newNode(t, "node-b", remote, Options{})
	c := newNode(t, "node-c", remote, Options{})
	t0 := time.Now().Add(-time.Minute).UTC().Truncate(time.Millisecond)
	for i, tc := range []struct {
		n  *node
		id string
		at time.Time
	}{
		// The younger one publishes first: the order of publication does not matter.
		{b, "snap-younger", t0.Add(time.Second)},
		{a, "snap-older", t0},
	} {
		files, _ := stackLayers(t, t.TempDir(), 1, uint64(40+i))
		tpl := catalog.Template{ID: tc.id, Kind: catalog.KindSnapshot, Aliases: []string{"shared"}, Backend: "oci",
			Artifact: captureArtifact(t, files), CreatedAt: tc.at}
		if err := tc.n.cat.Templates().Put(tpl); err != nil {
			t.Fatal(err)
		}
		h, err := tc.n.pub.PublishTemplate(ctx, tpl, "0.5.15")
		if err != nil {
			t.Fatal(err)
		}
		if err := h.Wait(ctx); err != nil {
			t.Fatal(err)
		}
	}
	for _, n := range []*node{a, b, c, a, b} { // twice: a settled clash stays settled
		if _, err := n.pub.Sync(ctx); err != nil {
			t.Fatalf("%s sync: %v", n.name, err)
		}
	}
	for _, n := range []*node{a, b, c} {
		got, err := n.cat.Templates().Resolve("shared")
		if err != nil || got.ID != "snap-older" {
			t.Errorf("%s resolves the shared name to %q (%v), want snap-older", n.name, got.ID, err)
		}
		y, err := n.cat.Templates().Get("snap-younger")
		if err != nil || slices.Contains(y.Aliases, "shared") {
			t.Errorf("%s: the younger snapshot is %+v (%v), want it by id without the name", n.name, y.Aliases, err)
		}
		if !got.CreatedAt.Equal(t0) {
			t.Errorf("%s: the older snapshot's age is %v, want %v (carried by its record)", n.name, got.CreatedAt, t0)
		}
	}
}
