package main

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"syscall"
	"testing"

	"github.com/aenv-dev/aenv/internal/storage/lsmt"
)

// tornLayer makes a writable layer of three 4 KiB blocks (values 1, 2, 3)
// whose second index entry points past the data file.
func tornLayer(t *testing.T, dir string) (data, index string) {
	t.Helper()
	data, index = filepath.Join(dir, "up.data"), filepath.Join(dir, "up.index")
	if _, err := runLayer(t, "create", data, "--size", "1M"); err != nil {
		t.Fatal(err)
	}
	l, err := lsmt.OpenRW(data, index)
	if err != nil {
		t.Fatal(err)
	}
	for k := range 3 {
		if _, err := l.WriteAt(bytes.Repeat([]byte{byte(k + 1)}, 4096), int64(k)*4096); err != nil {
			t.Fatal(err)
		}
	}
	if err := l.Close(); err != nil {
		t.Fatal(err)
	}
	idx, _ := os.ReadFile(index)
	e := idx[lsmt.HeaderSize+16:]
	m := lsmt.DecodeMapping(e)
	m.MOffset = 1 << 40
	lsmt.EncodeMapping(e, m)
	if err := os.WriteFile(index, idx, 0o644); err != nil {
		t.Fatal(err)
	}
	return data, index
}

// TestLayerReadOnlyCommandsKeepTornLayer: inspect, cat and commit never
// change a layer, even one whose index has a torn entry, and keep the
// entries after it.
func TestLayerReadOnlyCommandsKeepTornLayer(t *testing.T) {
	dir := t.TempDir()
	data, index := tornLayer(t, dir)
	dataBefore, _ := os.ReadFile(data)
	idxBefore, _ := os.ReadFile(index)
	unchanged := func(what string) {
		t.Helper()
		d, _ := os.ReadFile(data)
		i, _ := os.ReadFile(index)
		if !bytes.Equal(d, dataBefore) || !bytes.Equal(i, idxBefore) {
			t.Fatalf("%s changed the layer", what)
		}
	}
	out, err := runLayer(t, "inspect", data, "-o", "json")
	if err != nil {
		t.Fatal(err)
	}
	unchanged("inspect")
	var info layerInfo
	if err := json.Unmarshal([]byte(out), &info); err != nil {
		t.Fatal(err)
	}
	if !slices.Equal(info.Torn, []int{1}) || info.Entries != 2 {
		t.Fatalf("inspect: torn %v, %d entries; want [1], 2", info.Torn, info.Entries)
	}
	mp := filepath.Join(dir, "stack.json")
	os.WriteFile(mp, []byte(`{"upper":{"data":"up.data","index":"up.index"}}`), 0o644)
	got, err := runLayer(t, "cat", mp, "--length", "12288")
	if err != nil {
		t.Fatal(err)
	}
	unchanged("cat")
	want := slices.Concat(bytes.Repeat([]byte{1}, 4096), make([]byte, 4096), bytes.Repeat([]byte{3}, 4096))
	if got != string(want) {
		t.Fatal("cat lost the entry after the torn one")
	}
	if _, err := runLayer(t, "commit", data, filepath.Join(dir, "c.commit")); err != nil {
		t.Fatal(err)
	}
	unchanged("commit")
	got, err = runLayer(t, "cat", filepath.Join(dir, "c.commit"), "--length", "12288")
	if err != nil || got != string(want) {
		t.Fatalf("commit lost the entry after the torn one (%v)", err)
	}
}

// TestLayerCatCancel: a cancelled context stops cat in its copy loop.
func TestLayerCatCancel(t *testing.T) {
	dir := t.TempDir()
	data := filepath.Join(dir, "big.data")
	if _, err := runLayer(t, "create", data, "--size", "1T"); err != nil {
		t.Fatal(err)
	}
	mp := filepath.Join(dir, "stack.json")
	os.WriteFile(mp, []byte(`{"upper":{"data":"big.data","index":"big.index"}}`), 0o644)
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	cmd := newLayerCmd()
	var out bytes.Buffer
	cmd.SetOut(&out)
	cmd.SetErr(&out)
	cmd.SetArgs([]string{"cat", mp})
	if err := cmd.ExecuteContext(ctx); !errors.Is(err, context.Canceled) {
		t.Fatalf("cat with a cancelled context: %v", err)
	}
	if out.Len() > 0 && !strings.Contains(out.String(), "Error") {
		t.Fatalf("cat wrote %d bytes after cancellation", out.Len())
	}
}

// TestLayerCatHoles: cat into a regular file leaves the disk's zeros as holes.
func TestLayerCatHoles(t *testing.T) {
	dir := t.TempDir()
	raw := filepath.Join(dir, "disk.raw")
	f, _ := os.Create(raw)
	f.Truncate(64 << 20)
	f.WriteAt(bytes.Repeat([]byte{7}, 5000), 33<<20+100)
	f.Close()
	if _, err := runLayer(t, "import", raw, filepath.Join(dir, "disk.commit")); err != nil {
		t.Fatal(err)
	}
	outPath := filepath.Join(dir, "out.raw")
	out, err := os.Create(outPath)
	if err != nil {
		t.Fatal(err)
	}
	cmd := newLayerCmd()
	cmd.SetOut(out)
	cmd.SetArgs([]string{"cat", filepath.Join(dir, "disk.commit")})
	if err := cmd.Execute(); err != nil {
		t.Fatal(err)
	}
	out.Close()
	want, _ := os.ReadFile(raw)
	got, _ := os.ReadFile(outPath)
	if !bytes.Equal(got, want) {
		t.Fatalf("cat output differs from the image (%d vs %d bytes)", len(got), len(want))
	}
	var st syscall.Stat_t
	if err := syscall.Stat(outPath, &st); err != nil {
		t.Fatal(err)
	}
	if used := st.Blocks * 512; used > 1<<20 {
		t.Fatalf("cat wrote %d bytes of disk for a 64 MiB image holding 5000 bytes: zeros not left as holes", used)
	}
}
