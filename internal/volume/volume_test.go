package volume

import (
	"errors"
	"io"
	"os"
	"path/filepath"
	"strings"
	"testing"
)

func TestVolumesPersistAndAreScoped(t *testing.T) {
	dir := t.TempDir()
	s, err := Open(dir, Options{MaxPerOwner: 2})
	if err != nil {
		t.Fatal(err)
	}
	v, err := s.Create("alice", "data")
	if err != nil {
		t.Fatal(err)
	}
	if _, err := s.Create("alice", "data"); !errors.Is(err, ErrExists) {
		t.Fatalf("name clash: %v", err)
	}
	if _, err := s.Create("bob", "data"); err != nil {
		t.Fatalf("same name, other owner: %v", err)
	}
	if _, err := s.Create("alice", "two"); err != nil {
		t.Fatal(err)
	}
	if _, err := s.Create("alice", "three"); !errors.Is(err, ErrQuota) {
		t.Fatalf("quota: %v", err)
	}
	for _, bad := range []string{"", "-x", "a/b", "..", strings.Repeat("a", 64), "sp ace"} {
		if _, err := s.Create("carol", bad); !errors.Is(err, ErrInvalid) {
			t.Errorf("name %q: %v", bad, err)
		}
	}
	if l := s.List("carol"); len(l) != 0 {
		t.Fatalf("bad names created %v", l)
	}
	if _, err := s.Get("bob", v.ID); !errors.Is(err, ErrNotFound) {
		t.Fatalf("bob sees alice's volume: %v", err)
	}
	if err := os.WriteFile(filepath.Join(s.Dir(v.ID), "f"), []byte("kept"), 0o644); err != nil {
		t.Fatal(err)
	}
	tok := s.Token(v)

	s2, err := Open(dir, Options{})
	if err != nil {
		t.Fatal(err)
	}
	got, err := s2.Get("alice", "data")
	if err != nil || got.ID != v.ID {
		t.Fatalf("after reopen: %+v %v", got, err)
	}
	if _, err := s2.CheckToken(v.ID, tok); err != nil {
		t.Fatalf("token after reopen: %v", err)
	}
	if _, err := s2.CheckToken(v.ID, tok+"x"); !errors.Is(err, ErrNotFound) {
		t.Fatalf("bad token: %v", err)
	}
	if raw, err := os.ReadFile(filepath.Join(s2.Dir(v.ID), "f")); err != nil || string(raw) != "kept" {
		t.Fatalf("content after reopen: %q %v", raw, err)
	}
	if err := s2.Delete("bob", v.ID); !errors.Is(err, ErrNotFound) {
		t.Fatalf("bob deletes alice's: %v", err)
	}
	if err := s2.Delete("alice", v.ID); err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(filepath.Join(dir, v.ID)); !errors.Is(err, os.ErrNotExist) {
		t.Fatalf("content left after delete: %v", err)
	}
	s3, err := Open(dir, Options{})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := s3.Get("alice", "data"); !errors.Is(err, ErrNotFound) {
		t.Fatalf("deleted volume back after reopen: %v", err)
	}
}

func TestContentOperations(t *testing.T) {
	s, err := Open(t.TempDir(), Options{})
	if err != nil {
		t.Fatal(err)
	}
	v, err := s.Create("o", "c")
	if err != nil {
		t.Fatal(err)
	}
	c, err := s.Open(v.ID)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	e, err := c.WriteFile("/a/b/hello.txt", strings.NewReader("hi"), Owner{})
	if err != nil {
		t.Fatal(err)
	}
	if e.Type != "file" || e.Size != 2 || e.Path != "/a/b/hello.txt" || e.Name != "hello.txt" || e.Mode != 0o644 {
		t.Fatalf("entry = %+v", e)
	}
	if os.Geteuid() == 0 && (e.UID != DefaultUID || e.GID != DefaultGID) {
		t.Fatalf("owner = %d:%d", e.UID, e.GID)
	}
	f, _, err := c.OpenFile("a/b/hello.txt")
	if err != nil {
		t.Fatal(err)
	}
	raw, _ := io.ReadAll(f)
	f.Close()
	if string(raw) != "hi" {
		t.Fatalf("read %q", raw)
	}
	list, err := c.List("/", 3)
	if err != nil || len(list) != 3 {
		t.Fatalf("list depth 3 = %+v %v", list, err)
	}
	if list, _ := c.List("/", 1); len(list) != 1 || list[0].Type != "directory" {
		t.Fatalf("list depth 1 = %+v", list)
	}
	mode := uint32(0o600)
	if e, err := c.SetAttr("/a/b/hello.txt", nil, nil, &mode); err != nil || e.Mode != 0o600 {
		t.Fatalf("setattr = %+v %v", e, err)
	}
	if _, err := c.MakeDir("/x/y", false, Owner{}); !errors.Is(err, ErrPathNotFound) {
		t.Fatalf("mkdir without parents: %v", err)
	}
	if _, err := c.MakeDir("/x/y", true, Owner{}); err != nil {
		t.Fatal(err)
	}
	if _, err := c.MakeDir("/x/y", false, Owner{}); !errors.Is(err, ErrPathExists) {
		t.Fatalf("mkdir existing: %v", err)
	}
	// Paths never leave the volume, by .. or by a symbolic link made in a sandbox.
	if err := os.Symlink("/etc", filepath.Join(s.Dir(v.ID), "evil")); err != nil {
		t.Fatal(err)
	}
	if _, _, err := c.OpenFile("/evil/passwd"); err == nil {
		t.Fatal("read through a symlink out of the volume")
	}
	if _, err := c.WriteFile("/evil/x", strings.NewReader("x"), Owner{}); err == nil {
		t.Fatal("wrote through a symlink out of the volume")
	}
	if _, err := c.Stat("/../../etc/passwd"); !errors.Is(err, ErrPathNotFound) {
		t.Fatalf("dotdot: %v", err)
	}
	if _, _, err := c.OpenFile("/a"); !errors.Is(err, ErrIsDir) {
		t.Fatalf("read dir: %v", err)
	}
	if err := c.Remove("/"); !errors.Is(err, ErrInvalid) {
		t.Fatalf("remove root: %v", err)
	}
	if err := c.Remove("/a"); err != nil {
		t.Fatal(err)
	}
	if err := c.Remove("/a"); !errors.Is(err, ErrPathNotFound) {
		t.Fatalf("remove twice: %v", err)
	}
	big := uint32(0o17777)
	if _, err := c.SetAttr("/x", nil, nil, &big); !errors.Is(err, ErrInvalid) {
		t.Fatalf("bad mode: %v", err)
	}
}
