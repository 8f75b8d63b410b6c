package oci

import (
	"os"
	"path/filepath"
	"reflect"
	"sort"
	"strconv"
	"testing"

	"golang.org/x/sys/unix"
)

// mountFixture builds a sandbox-like directory under a fresh temporary directory and
// mounts tmpfs (or binds a file) at the paths given, in order; it unmounts whatever is
// left when the test ends.
func mountFixture(t *testing.T, files int, mounts ...string) string {
	t.Helper()
	if os.Geteuid() != 0 {
		t.Skip("needs root to mount")
	}
	dir := filepath.Join(t.TempDir(), "sb")
	t.Cleanup(func() {
		m, _ := mountsUnder(dir)
		_ = detachAll(m)
	})
	for _, d := range []string{"rootfs", "blk/fuse", "blk/many", "upper/etc"} {
		if err := os.MkdirAll(filepath.Join(dir, d), 0o755); err != nil {
			t.Fatal(err)
		}
	}
	for i := range files {
		if err := os.WriteFile(filepath.Join(dir, "blk", "many", strconv.Itoa(i)), nil, 0o644); err != nil {
			t.Fatal(err)
		}
	}
	for _, m := range mounts {
		p := filepath.Join(dir, m)
		if filepath.Ext(m) == ".file" {
			src := filepath.Join(t.TempDir(), "src")
			for _, f := range []string{src, p} {
				if err := os.WriteFile(f, nil, 0o644); err != nil {
					t.Fatal(err)
				}
			}
			if err := unix.Mount(src, p, "", unix.MS_BIND, ""); err != nil {
				t.Fatal(err)
			}
			continue
		}
		if err := os.MkdirAll(p, 0o755); err != nil {
			t.Fatal(err)
		}
		if err := unix.Mount("tmpfs", p, "tmpfs", 0, "size=1m"); err != nil {
			t.Fatal(err)
		}
	}
	return dir
}

func TestUnmountAll(t *testing.T) {
	tests := []struct {
		name    string
		files   int      // files in blk/many/ (a big bundle makes the walk give up)
		mounts  []string // relative to the sandbox directory, in mount order
		found   []string // findMounts' first answer, sorted; nil with walkErr
		walkErr bool
		kept    bool // unmountAll leaves the mounts (where the walk does not look)
	}{
		{name: "none"},
		{name: "block root", mounts: []string{"blk/fuse", "rootfs"}, found: []string{"blk/fuse", "rootfs"}},
		{name: "nested below a mount", mounts: []string{"rootfs", "rootfs/proc"}, found: []string{"rootfs"}},
		{name: "stacked", mounts: []string{"rootfs", "rootfs"}, found: []string{"rootfs"}},
		{name: "hidden under a later mount", mounts: []string{"blk/fuse", "blk"}, found: []string{"blk"}},
		{name: "a file bind", mounts: []string{"init.file"}, found: []string{"init.file"}},
		{name: "deep in the bundle", mounts: []string{"blk/many/deep"}, found: []string{"blk/many/deep"}},
		// The sandbox writes upper/: never mounted on, and never entered (notEntered).
		{name: "not in the sandbox's upper", mounts: []string{"upper/etc"}, kept: true},
		{name: "the directory itself", mounts: []string{".", "rootfs"}, walkErr: true},
		{name: "over budget", files: walkBudget, mounts: []string{"rootfs"}, walkErr: true},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			dir := mountFixture(t, tc.files, tc.mounts...)
			found, err := findMounts(dir, walkBudget)
			if (err != nil) != tc.walkErr {
				t.Fatalf("findMounts: err %v, want an error: %v", err, tc.walkErr)
			}
			var rel []string
			for _, f := range found {
				r, _ := filepath.Rel(dir, f)
				rel = append(rel, r)
			}
			sort.Strings(rel)
			if !reflect.DeepEqual(rel, tc.found) {
				t.Errorf("findMounts = %q, want %q", rel, tc.found)
			}
			if err := unmountAll(dir); err != nil {
				t.Fatal(err)
			}
			if m, err := mountsUnder(dir); err != nil || (len(m) > 0) != tc.kept {
				t.Errorf("after unmountAll: mounts %q (err %v), want some: %v", m, err, tc.kept)
			}
		})
	}
	if err := unmountAll(filepath.Join(t.TempDir(), "missing")); err != nil {
		t.Errorf("unmountAll of a missing directory: %v", err)
	}
}

// BenchmarkUnmountAllBlockBundle is a kill's unmountAll of a block root's bundle whose
// mounts its Close already took (the usual case): a walk, whatever the host's table holds.
func BenchmarkUnmountAllBlockBundle(b *testing.B) {
	dir := b.TempDir()
	for _, d := range []string{"rootfs", "blk/fuse"} {
		if err := os.MkdirAll(filepath.Join(dir, d), 0o755); err != nil {
			b.Fatal(err)
		}
	}
	for _, f := range []string{"config.json", "state.json", "init.pid", "init.log", "upper.data", "upper.index"} {
		if err := os.WriteFile(filepath.Join(dir, f), nil, 0o644); err != nil {
			b.Fatal(err)
		}
	}
	for i := 0; i < b.N; i++ {
		if err := unmountAll(dir); err != nil {
			b.Fatal(err)
		}
	}
}

// TestWalkFollowsNoSymlink: a directory the walk is about to read, or a mount it is about
// to detach, that became a symlink (to a mount outside the bundle here) is refused, not
// followed: the mount outside stays.
func TestWalkFollowsNoSymlink(t *testing.T) {
	outside := mountFixture(t, 0, "rootfs")
	target := filepath.Join(outside, "rootfs")
	if err := os.WriteFile(filepath.Join(target, "host-file"), nil, 0o644); err != nil {
		t.Fatal(err)
	}
	link := filepath.Join(t.TempDir(), "swapped")
	if err := os.Symlink(target, link); err != nil {
		t.Fatal(err)
	}
	if names, err := readNames(link); err == nil {
		t.Errorf("readNames followed a symlink out of the bundle and listed %q", names)
	}
	if err := detachAll([]string{link}); err != nil {
		t.Errorf("detachAll of a symlink: %v (want it skipped, like a path that is not a mount)", err)
	}
	if m, _ := mountsUnder(outside); len(m) != 1 {
		t.Errorf("the mount the symlink points at: %q, want it still mounted", m)
	}
}
