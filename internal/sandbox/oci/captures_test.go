package oci

import (
	"context"
	"encoding/json"
	"io"
	"log/slog"
	"os"
	"path/filepath"
	"slices"
	"testing"

	"github.com/aenv-dev/aenv/internal/storage/stack"
)

// ReconcileCaptures keeps the captures some artifact names (directly, nested in a paused
// state or a build template, in any referenced document) with their layers, and drops
// the others, their layers and interrupted record writes; an unreadable artifact keeps
// everything.
func TestReconcileCaptures(t *testing.T) {
	for _, tc := range []struct {
		name       string
		referenced []string
		wantKept   []string // capture ids left
		wantErr    bool
	}{
		{"nothing referenced", nil, nil, false},
		{"a snapshot's artifact", []string{`{"version":1,"backend":"oci","id":"cap-a","layers":[]}`}, []string{"cap-a"}, false},
		{"a disk-paused record", []string{`{"id":"sbx","disk":{"id":"cap-b","layers":[]}}`}, []string{"cap-b"}, false},
		{"an id without layers names no capture", []string{`{"id":"cap-a"}`}, nil, false},
		{"several", []string{`{"id":"cap-a","layers":[]}`, ``, `{"kind":"build-layers","capture":{"id":"cap-c","layers":[]}}`}, []string{"cap-a", "cap-c"}, false},
		{"unreadable artifact keeps everything", []string{`{"id":"cap-a","layers":[]}`, `{not json`}, []string{"cap-a", "cap-b", "cap-c"}, true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			dir := t.TempDir()
			b := &Backend{cfg: Config{DataDir: dir}, log: slog.New(slog.NewTextHandler(io.Discard, nil)), instances: map[string]*Instance{}}
			for _, d := range []string{b.capturesDir(), b.layersDir()} {
				if err := os.MkdirAll(d, 0o755); err != nil {
					t.Fatal(err)
				}
			}
			for _, id := range []string{"cap-a", "cap-b", "cap-c"} {
				layer := filepath.Join(b.layersDir(), id+".commit")
				if err := os.WriteFile(layer, []byte(id), 0o444); err != nil {
					t.Fatal(err)
				}
				c := &Captured{Version: captureVersion, Backend: "oci", ID: id, Layers: []stack.LayerRef{{Path: layer, UUID: "u-" + id}}}
				if err := writeCapture(b.capturePath(id), c); err != nil {
					t.Fatal(err)
				}
			}
			// A record write the crash interrupted.
			if err := os.WriteFile(b.capturePath("cap-d")+".tmp", []byte("{"), 0o600); err != nil {
				t.Fatal(err)
			}
			var refs []json.RawMessage
			for _, r := range tc.referenced {
				refs = append(refs, json.RawMessage(r))
			}
			err := b.ReconcileCaptures(context.Background(), refs)
			if (err != nil) != tc.wantErr {
				t.Fatalf("ReconcileCaptures: %v, want error %v", err, tc.wantErr)
			}
			var kept, layers []string
			ents, _ := os.ReadDir(b.capturesDir())
			for _, e := range ents {
				kept = append(kept, e.Name())
			}
			ents, _ = os.ReadDir(b.layersDir())
			for _, e := range ents {
				layers = append(layers, e.Name())
			}
			var wantFiles, wantLayers []string
			for _, id := range tc.wantKept {
				wantFiles = append(wantFiles, id+".json")
				wantLayers = append(wantLayers, id+".commit")
			}
			if tc.wantErr {
				wantFiles = append(wantFiles, "cap-d.json.tmp")
			}
			slices.Sort(wantFiles)
			if !slices.Equal(kept, wantFiles) || !slices.Equal(layers, wantLayers) {
				t.Errorf("left captures %v and layers %v, want %v and %v", kept, layers, wantFiles, wantLayers)
			}
		})
	}
}
