package unpack

import (
	"archive/tar"
	"bytes"
	"context"
	"os"
	"path/filepath"
	"testing"
)

// FuzzApply feeds arbitrary bytes as a layer tar (seeded with well-formed and
// hostile layers, plus the committed corpus in testdata/fuzz/FuzzApply) and
// checks the one property that must always hold: whatever the tar says and
// whether or not Apply fails, nothing outside the root changes.
func FuzzApply(f *testing.F) {
	for _, ents := range [][]ent{
		{{name: "a/", typ: tar.TypeDir}, {name: "a/b", body: "x"}, {name: "a/l", typ: tar.TypeSymlink, link: "/a/b"}},
		{{name: "l", typ: tar.TypeSymlink, link: "/"}, {name: "l/x", body: "x"}},
		{{name: "l", typ: tar.TypeSymlink, link: "../.."}, {name: "l/x", body: "x"}, {name: "h", typ: tar.TypeLink, link: "l/x"}},
		{{name: "l", typ: tar.TypeSymlink, link: "../outside"}, {name: "l/.wh.canary"}, {name: "l/.wh..wh..opq"}},
		{{name: "d/", typ: tar.TypeDir}, {name: "d/.wh..wh..opq"}, {name: "d/n", body: "n"}, {name: ".wh.d"}},
		{{name: "../x", body: "x"}},
		{{name: "f", typ: tar.TypeFifo}, {name: "c", typ: tar.TypeChar, major: 1, minor: 3}},
	} {
		f.Add(mkTar(f, ents...))
	}
	f.Fuzz(func(t *testing.T, layer []byte) {
		top := t.TempDir()
		root := filepath.Join(top, "root")
		outside := filepath.Join(top, "outside")
		os.Mkdir(root, 0o755)
		os.Mkdir(outside, 0o755)
		canary := filepath.Join(outside, "canary")
		os.WriteFile(canary, []byte("safe"), 0o644)
		Apply(context.Background(), root, bytes.NewReader(layer), Options{})
		if b, err := os.ReadFile(canary); err != nil || string(b) != "safe" {
			t.Fatalf("canary outside the root = %q, %v", b, err)
		}
		if es, _ := os.ReadDir(outside); len(es) != 1 {
			t.Fatalf("outside now holds %d entries", len(es))
		}
		if es, _ := os.ReadDir(top); len(es) != 2 {
			t.Fatalf("top now holds %d entries", len(es))
		}
	})
}
