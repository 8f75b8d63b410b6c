package main

import (
	"bytes"
	"encoding/json"
	"math/rand/v2"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/aenv-dev/aenv/internal/storage/lsmt"
)

func runLayer(t *testing.T, args ...string) (string, error) {
	t.Helper()
	cmd := newLayerCmd()
	var out, errb bytes.Buffer
	cmd.SetOut(&out)
	cmd.SetErr(&errb)
	cmd.SetArgs(args)
	err := cmd.Execute()
	return out.String(), err
}

func TestLayerImportInspectCat(t *testing.T) {
	dir := t.TempDir()
	raw := filepath.Join(dir, "disk.raw")
	f, _ := os.Create(raw)
	f.Truncate(8 << 20)
	r := rand.New(rand.NewPCG(1, 1))
	data := make([]byte, 100000)
	for i := range data {
		data[i] = byte(r.Uint32())
	}
	f.WriteAt(data, 3<<20+17)
	f.Close()
	want, _ := os.ReadFile(raw)
	for _, z := range []string{"", "lz4", "zstd", "lz4+tar"} {
		t.Run("z="+z, func(t *testing.T) {
			out := filepath.Join(dir, "layer-"+z)
			args := []string{"import", raw, out}
			if z, ok := strings.CutSuffix(z, "+tar"); ok {
				args = append(args, "-t", "-z", z)
			} else if z != "" {
				args = append(args, "-z", z)
			}
			res, err := runLayer(t, args...)
			if err != nil || !strings.HasPrefix(res, "sha256:") {
				t.Fatalf("import: %q %v", res, err)
			}
			js, err := runLayer(t, "inspect", out, "-o", "json")
			if err != nil {
				t.Fatal(err)
			}
			var info layerInfo
			if err := json.Unmarshal([]byte(js), &info); err != nil {
				t.Fatal(err)
			}
			if info.VirtualSize != 8<<20 || info.Entries == 0 || info.Trailer == nil || info.Trailer.Flags != 0x06 ||
				(z != "") != (info.ZFile != nil) || strings.HasSuffix(z, "+tar") != (info.Tar != nil) {
				t.Fatalf("inspect: %+v", info)
			}
			// Holes stay holes: only the written range (rounded to 4 KiB) is mapped.
			var mapped uint64
			for _, e := range info.Index {
				mapped += uint64(e.Length) * 512
			}
			if mapped > 2*4096+uint64(len(data)) {
				t.Fatalf("mapped %d bytes for %d bytes of data", mapped, len(data))
			}
			got, err := runLayer(t, "cat", out)
			if err != nil || got != string(want) {
				t.Fatalf("cat: %v (len %d)", err, len(got))
			}
			part, err := runLayer(t, "cat", out, "--offset", "3145800", "--length", "1000")
			if err != nil || part != string(want[3145800:3146800]) {
				t.Fatalf("cat range: %v", err)
			}
		})
	}
}

func TestLayerCreateCommitSeal(t *testing.T) {
	dir := t.TempDir()
	d := filepath.Join(dir, "up.data")
	if _, err := runLayer(t, "create", d, "--size", "16M"); err != nil {
		t.Fatal(err)
	}
	l, err := lsmt.OpenRW(d, filepath.Join(dir, "up.index"))
	if err != nil {
		t.Fatal(err)
	}
	p := bytes.Repeat([]byte{9}, 8192)
	l.WriteAt(p, 1<<20)
	l.WriteAt(p[:4096], 1<<20) // garbage left behind in the RW file
	l.Sync()
	l.Close()
	c := filepath.Join(dir, "c.commit")
	if _, err := runLayer(t, "commit", d, c, "-z", "zstd"); err != nil {
		t.Fatal(err)
	}
	got, err := runLayer(t, "cat", c, "--offset", "1M", "--length", "8K")
	if err != nil || got != string(p) {
		t.Fatalf("cat commit: %v", err)
	}
	s := filepath.Join(dir, "s.sealed")
	if _, err := runLayer(t, "commit", d, s, "--seal"); err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(d); !os.IsNotExist(err) {
		t.Fatal("RW file still present after --seal")
	}
	got, err = runLayer(t, "cat", s, "--offset", "1M", "--length", "8K")
	if err != nil || got != string(p) {
		t.Fatalf("cat sealed: %v", err)
	}
}

func TestLayerGolden(t *testing.T) {
	hw := "../../internal/storage/blob/testdata/hw_layer.bin"
	out, err := runLayer(t, "inspect", hw)
	if err != nil {
		t.Fatal(err)
	}
	for _, want := range []string{"01BB4FCE-3EB1-B56B-05AD-F99504DAFD31", "515 valid, 253 padding", "crc ok", "virtual_size:  68719476736"} {
		if !strings.Contains(out, want) {
			t.Errorf("inspect output lacks %q:\n%s", want, out[:min(len(out), 2000)])
		}
	}
	b, err := runLayer(t, "cat", hw, "--offset", "1080", "--length", "2")
	if err != nil || b != "\x53\xef" {
		t.Fatalf("cat magic %q %v", b, err)
	}
}

func TestLayerErrors(t *testing.T) {
	dir := t.TempDir()
	junk := filepath.Join(dir, "junk")
	os.WriteFile(junk, bytes.Repeat([]byte{1}, 9000), 0o644)
	for _, args := range [][]string{
		{"inspect", junk},
		{"inspect", filepath.Join(dir, "missing")},
		{"cat", junk},
		{"create", filepath.Join(dir, "x"), "--size", "1000"},
		{"create", filepath.Join(dir, "y"), "--size", "lots"},
		{"import", junk, filepath.Join(dir, "o"), "-z", "brotli"},
	} {
		if _, err := runLayer(t, args...); err == nil {
			t.Errorf("%v: no error", args)
		} else if args[0] == "inspect" && !strings.Contains(err.Error(), dir) {
			t.Errorf("%v: error does not name the file: %v", args, err)
		}
	}
	if _, err := os.Stat(filepath.Join(dir, "o")); !os.IsNotExist(err) {
		t.Error("failed import left output")
	}
}

func TestLayerCatStack(t *testing.T) {
	dir := t.TempDir()
	raw := filepath.Join(dir, "a.raw")
	os.WriteFile(raw, bytes.Repeat([]byte{1}, 1<<20), 0o644)
	if _, err := runLayer(t, "import", raw, filepath.Join(dir, "a.commit"), "-z", "lz4", "-t"); err != nil {
		t.Fatal(err)
	}
	raw2 := filepath.Join(dir, "b.raw")
	f, _ := os.Create(raw2)
	f.Truncate(1 << 20)
	f.WriteAt(bytes.Repeat([]byte{2}, 4096), 8192)
	f.Close()
	if _, err := runLayer(t, "import", raw2, filepath.Join(dir, "b.commit")); err != nil {
		t.Fatal(err)
	}
	m := `{"lowers":[{"path":"a.commit"},{"path":"b.commit"}],"upper":{"data":"missing.data","index":"missing.index"}}`
	mp := filepath.Join(dir, "stack.json")
	os.WriteFile(mp, []byte(m), 0o644)
	got, err := runLayer(t, "cat", mp, "--offset", "4096", "--length", "12288")
	if err != nil {
		t.Fatal(err)
	}
	want := append(append(bytes.Repeat([]byte{1}, 4096), bytes.Repeat([]byte{2}, 4096)...), bytes.Repeat([]byte{1}, 4096)...)
	if got != string(want) {
		t.Fatal("stack cat mismatch")
	}
	if _, err := os.Stat(filepath.Join(dir, "missing.data")); !os.IsNotExist(err) {
		t.Fatal("cat created an upper")
	}
}
