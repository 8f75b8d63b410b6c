package stack

import (
	"bytes"
	"context"
	"os"
	"path/filepath"
	"testing"
)

func TestLoadOverlaybdConfig(t *testing.T) {
	ctx := context.Background()
	dir := t.TempDir()
	// Build a lower by sealing a stack's upper.
	s, _ := newStack(t, 0)
	s.WriteAt(bytes.Repeat([]byte{3}, 4096), 8192)
	os.MkdirAll(filepath.Join(dir, "l1"), 0o755)
	if _, err := s.SealAndRestack(ctx, filepath.Join(dir, "l1", "overlaybd.sealed")); err != nil {
		t.Fatal(err)
	}
	cfg := `{"repoBlobUrl":"https://reg/v2/ns/app/blobs","lowers":[{"dir":"l1"}],
		"upper":{"mode":"logStructured","index":"upper.index","data":"upper.data"},"resultFile":"result.txt"}`
	p := filepath.Join(dir, "image.json")
	os.WriteFile(p, []byte(cfg), 0o644)
	m, repo, err := LoadOverlaybdConfig(p)
	if err != nil {
		t.Fatal(err)
	}
	if repo != "https://reg/v2/ns/app/blobs" || len(m.Lowers) != 1 || m.Lowers[0].Path != "l1/overlaybd.sealed" || m.Upper == nil {
		t.Fatalf("manifest %+v", m)
	}
	s2, err := Open(ctx, m, Options{})
	if err != nil {
		t.Fatal(err)
	}
	defer s2.Close()
	got := make([]byte, 4096)
	s2.ReadAt(got, 8192)
	if !bytes.Equal(got, bytes.Repeat([]byte{3}, 4096)) {
		t.Fatal("lower content not visible")
	}
	for _, bad := range []string{
		`{"lowers":[{"gzipIndex":"x","file":"a"}]}`,
		`{"lowers":[{}]}`,
		`{"lowers":[],"upper":{"mode":"turbo","data":"d","index":"i"}}`,
		`{"lowers":`,
	} {
		os.WriteFile(p, []byte(bad), 0o644)
		if _, _, err := LoadOverlaybdConfig(p); err == nil {
			t.Errorf("%s accepted", bad)
		}
	}
}
