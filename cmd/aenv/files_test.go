package main

import (
	"bytes"
	"context"
	"os"
	"path/filepath"
	"testing"

	"github.com/spf13/cobra"
)

// upload and download keep file modes and copy symlinks as links (envd runs on this host,
// so the "sandbox" side is checked on the local filesystem).
func TestUploadDownloadModesAndSymlinks(t *testing.T) {
	e := realEnvd(t)
	cmd := &cobra.Command{}
	cmd.SetContext(context.Background())
	var msgs bytes.Buffer
	cmd.SetErr(&msgs)

	src := t.TempDir()
	os.MkdirAll(filepath.Join(src, "sub"), 0o755)
	os.WriteFile(filepath.Join(src, "run.sh"), []byte("#!/bin/sh\necho hi\n"), 0o755)
	os.WriteFile(filepath.Join(src, "secret"), []byte("s"), 0o600)
	os.WriteFile(filepath.Join(src, "plain"), []byte("p"), 0o644)
	os.Symlink("../run.sh", filepath.Join(src, "sub", "rel"))
	os.Symlink("/etc/hostname", filepath.Join(src, "abs"))

	remote := filepath.Join(t.TempDir(), "up")
	if err := e.upload(cmd, src, remote, ""); err != nil {
		t.Fatalf("%v (%s)", err, msgs.String())
	}
	checkTree := func(root string, wantRel string) {
		t.Helper()
		for name, want := range map[string]os.FileMode{"run.sh": 0o755, "secret": 0o600, "plain": 0o644} {
			fi, err := os.Lstat(filepath.Join(root, name))
			if err != nil || fi.Mode() != want {
				t.Fatalf("%s/%s: mode %v (%v), want %v", root, name, fi.Mode(), err, want)
			}
		}
		for name, want := range map[string]string{"sub/rel": wantRel, "abs": "/etc/hostname"} {
			got, err := os.Readlink(filepath.Join(root, name))
			if err != nil || got != want {
				t.Fatalf("%s/%s: link to %q (%v), want %q", root, name, got, err, want)
			}
		}
	}
	checkTree(remote, "../run.sh")

	// A single file keeps its exec bit too.
	one := filepath.Join(t.TempDir(), "one.sh")
	if err := e.upload(cmd, filepath.Join(src, "run.sh"), one, ""); err != nil {
		t.Fatal(err)
	}
	if fi, err := os.Stat(one); err != nil || fi.Mode().Perm() != 0o755 {
		t.Fatalf("single upload: mode %v (%v), want 0755", fi.Mode(), err)
	}

	// Downloads: modes kept (not always 0600), links recreated as links.
	ent, err := e.statRemote(cmd, remote, "")
	if err != nil {
		t.Fatal(err)
	}
	local := filepath.Join(t.TempDir(), "down")
	if err := e.downloadDir(cmd, ent.GetPath(), local, "", false); err != nil {
		t.Fatal(err)
	}
	checkTree(local, "../run.sh")
	ent, err = e.statRemote(cmd, one, "")
	if err != nil {
		t.Fatal(err)
	}
	dl := filepath.Join(t.TempDir(), "dl.sh")
	if err := e.download(cmd, one, dl, "", os.FileMode(ent.GetMode()), false, false); err != nil {
		t.Fatal(err)
	}
	if fi, err := os.Stat(dl); err != nil || fi.Mode().Perm() != 0o755 {
		t.Fatalf("single download: mode %v (%v), want 0755", fi.Mode(), err)
	}
}
