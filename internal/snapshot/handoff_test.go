package snapshot

import (
	"context"
	"encoding/json"
	"errors"
	"sync"
	"testing"
	"time"

	"github.com/aenv-dev/aenv/internal/catalog"
	"github.com/aenv-dev/aenv/internal/repository/layers"
	"github.com/aenv-dev/aenv/internal/sandbox"
	"github.com/aenv-dev/aenv/internal/storage/cache"
)

// A handoff published by node A is claimed by exactly one of several nodes racing for
// it, the winner gets the capture and the sandbox record, A's own claim then fails, a
// released claim can be taken again, and sync registers handoffs nowhere.
func TestHandoffClaim(t *testing.T) {
	for _, b := range backends() {
		t.Run(b.name, func(t *testing.T) {
			ctx := context.Background()
			remote := b.open(t)
			a := newNode(t, "node-a", remote, Options{LazyLayers: true})
			files, model := stackLayers(t, t.TempDir(), 2, 7)
			const sbID = "sbxhandoff1"
			id := HandoffID(sbID, time.UnixMilli(1_700_000_000_000))
			tpl := catalog.Template{ID: id, Kind: catalog.KindSnapshot, Backend: "oci",
				Resources: sandbox.Resources{CPUCount: 1, MemoryMB: 256}, Artifact: captureArtifact(t, files),
				EnvdAccessToken: "tok", SourceSandboxID: sbID, CreatedAt: time.Now()}
			rec := json.RawMessage(`{"id":"` + sbID + `","metadata":{"k":"v"}}`)

			if _, _, err := a.pub.ClaimHandoff(ctx, sbID, "node-b"); !errors.Is(err, ErrNotFound) {
				t.Fatalf("claim before any publication: %v, want ErrNotFound", err)
			}
			if _, err := a.pub.PublishHandoff(ctx, catalog.Template{ID: "not-a-handoff"}, "", rec); !errors.Is(err, ErrInvalid) {
				t.Fatalf("publish under a non-handoff id: %v, want ErrInvalid", err)
			}
			h, err := a.pub.PublishHandoff(ctx, tpl, "0.5.15", rec)
			if err != nil {
				t.Fatal(err)
			}
			if err := h.Wait(ctx); err != nil {
				t.Fatal(err)
			}

			others := []*node{newNode(t, "node-b", remote, Options{LazyLayers: true}), newNode(t, "node-c", remote, Options{LazyLayers: true})}
			for _, n := range others {
				if _, err := n.pub.Sync(ctx); err != nil {
					t.Fatal(err)
				}
				if _, err := n.cat.Templates().Get(id); err == nil {
					t.Fatalf("sync registered handoff %s on %s", id, n.name)
				}
			}
			type result struct {
				n   *node
				t   catalog.Template
				raw json.RawMessage
				err error
			}
			results := make([]result, len(others))
			var wg sync.WaitGroup
			for i, n := range others {
				wg.Add(1)
				go func() {
					defer wg.Done()
					tt, raw, err := n.pub.ClaimHandoff(ctx, sbID, n.name)
					results[i] = result{n, tt, raw, err}
				}()
			}
			wg.Wait()
			var winner *result
			for i, r := range results {
				switch {
				case r.err == nil && winner == nil:
					winner = &results[i]
				case r.err == nil:
					t.Fatalf("both %s and %s claimed the handoff", winner.n.name, r.n.name)
				case !errors.Is(r.err, ErrClaimed):
					t.Fatalf("%s: %v, want ErrClaimed", r.n.name, r.err)
				}
			}
			if winner == nil {
				t.Fatal("no node claimed the handoff")
			}
			var got struct {
				ID       string            `json:"id"`
				Metadata map[string]string `json:"metadata"`
			}
			if json.Unmarshal(winner.raw, &got) != nil || got.ID != sbID || got.Metadata["k"] != "v" || winner.t.EnvdAccessToken != "tok" {
				t.Fatalf("claimed record %s token %q", winner.raw, winner.t.EnvdAccessToken)
			}
			if got := readLazyArtifact(t, winner.n, winner.t.Artifact); string(got) != string(model) {
				t.Fatal("the claimed capture does not read back the published layers")
			}
			if err := a.pub.ClaimOwnHandoff(ctx, id, "node-a"); !errors.Is(err, ErrClaimed) {
				t.Fatalf("the publisher's own claim after %s's: %v, want ErrClaimed", winner.n.name, err)
			}
			if moved, err := a.pub.HandoffClaimedElsewhere(ctx, id, "node-a"); err != nil || !moved {
				t.Fatalf("HandoffClaimedElsewhere = %v, %v", moved, err)
			}
			if err := winner.n.pub.ReleaseHandoff(ctx, id, winner.n.name); err != nil {
				t.Fatal(err)
			}
			if err := a.pub.ClaimOwnHandoff(ctx, id, "node-a"); err != nil {
				t.Fatalf("claim after the release: %v", err)
			}
			if _, err := a.pub.Delete(ctx, id); err != nil {
				t.Fatal(err)
			}
			if err := a.pub.ClaimOwnHandoff(ctx, id, "node-a"); !errors.Is(err, ErrClaimed) {
				t.Fatalf("claim of a deleted handoff: %v, want ErrClaimed", err)
			}
		})
	}
}

// readLazyArtifact reads the device an artifact registered with lazy layers names, from
// the repository through n's node cache.
func readLazyArtifact(t *testing.T, n *node, art json.RawMessage) []byte {
	t.Helper()
	bc, err := cache.Open(cache.Options{Dir: t.TempDir(), MaxBytes: 64 << 20, BlockSize: 64 << 10})
	if err != nil {
		t.Fatal(err)
	}
	defer bc.Close()
	res := &layers.Resolver{Repo: n.cache, Cache: bc, Remote: n.remote, Hashes: n.pub.HashIndex()}
	return readLazy(t, artifactRefs(t, art), res)
}
