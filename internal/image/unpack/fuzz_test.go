package unpack

import (
	"archive/tar"
	"bytes"
	"context"
	"os"
	"path/filepath"
	"strings"
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

// FuzzApplyEntries fuzzes layer structure rather than tar bytes: each line
// of the input is "<type><name>\x00<link target>" with type one of 0 (file),
// 1 (hard link), 2 (symlink), 5 (dir) or p (fifo), so the fuzzer explores
// combinations of names, links and whiteouts directly. Layers are applied
// twice (the second sees the first's links). Nothing outside the root may
// change.
func FuzzApplyEntries(f *testing.F) {
	for _, seed := range []string{
		"2l\x00/\n0l/evil\x00",
		"2l\x00../outside\n0l/canary\x00\n0l/.wh.canary\x00",
		"2a\x00b/..\n2b\x00../../..\n0a/x\x00",
		"5d\x00\n0d/.wh..wh..opq\x00\n1h\x00../outside/canary",
		"2l\x00../outside\n1h\x00l/canary\n2m\x00l/canary\n0m\x00",
		"2l\x00../outside\n5l\x00\n0l/canary\x00",
		"2x\x00x/y\n0x/y/z\x00",
	} {
		f.Add(seed)
	}
	f.Fuzz(func(t *testing.T, spec string) {
		var ents []ent
		for _, line := range strings.Split(spec, "\n") {
			if len(line) < 2 || len(ents) > 32 {
				continue
			}
			name, link, _ := strings.Cut(line[1:], "\x00")
			e := ent{name: name, link: link}
			switch line[0] {
			case '0':
				e.typ, e.body = tar.TypeReg, "pwned"
			case '1':
				e.typ = tar.TypeLink
			case '2':
				e.typ = tar.TypeSymlink
			case '5':
				e.typ = tar.TypeDir
			case 'p':
				e.typ = tar.TypeFifo
			default:
				continue
			}
			ents = append(ents, e)
		}
		var buf bytes.Buffer
		tw := tar.NewWriter(&buf)
		for _, e := range ents {
			h := &tar.Header{Name: e.name, Linkname: e.link, Typeflag: e.typ, Mode: 0o755, Size: int64(len(e.body))}
			if tw.WriteHeader(h) != nil {
				return
			}
			tw.Write([]byte(e.body))
		}
		tw.Close()
		top := t.TempDir()
		root := filepath.Join(top, "root")
		outside := filepath.Join(top, "outside")
		os.Mkdir(root, 0o755)
		os.Mkdir(outside, 0o755)
		canary := filepath.Join(outside, "canary")
		os.WriteFile(canary, []byte("safe"), 0o644)
		for range 2 {
			Apply(context.Background(), root, bytes.NewReader(buf.Bytes()), Options{})
		}
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
