package layered

import (
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"os"
	"os/exec"
	"path/filepath"
	"syscall"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/aenv-dev/aenv/internal/catalog"
	"github.com/aenv-dev/aenv/internal/image"
)

// smallTree makes a directory tree with a file, a subdirectory and a symlink.
func smallTree(t *testing.T) string {
	t.Helper()
	root := filepath.Join(t.TempDir(), "rootfs")
	for _, d := range []string{"bin", "home/user", "etc"} {
		if err := os.MkdirAll(filepath.Join(root, d), 0o755); err != nil {
			t.Fatal(err)
		}
	}
	if err := os.WriteFile(filepath.Join(root, "etc/hostname"), []byte("aenv\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(root, "bin/tool"), []byte("#!/bin/sh\necho hi\n"), 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.Symlink("tool", filepath.Join(root, "bin/alias")); err != nil {
		t.Fatal(err)
	}
	return root
}

func treeHash(t *testing.T, root string) string {
	t.Helper()
	h, err := TreeHash(context.Background(), root)
	if err != nil {
		t.Fatal(err)
	}
	return h
}

func TestTreeHash(t *testing.T) {
	later := time.Date(2030, 1, 2, 3, 4, 5, 0, time.UTC)
	tests := []struct {
		name   string
		root   bool // needs root (chown)
		change func(root string) error
		same   bool
	}{
		{"nothing", false, func(string) error { return nil }, true},
		{"read only", false, func(r string) error { _, err := os.ReadFile(filepath.Join(r, "etc/hostname")); return err }, true},
		{"content size", false, func(r string) error {
			return os.WriteFile(filepath.Join(r, "etc/hostname"), []byte("other-name\n"), 0o644)
		}, false},
		{"mtime", false, func(r string) error { return os.Chtimes(filepath.Join(r, "bin/tool"), later, later) }, false},
		{"mode", false, func(r string) error { return os.Chmod(filepath.Join(r, "bin/tool"), 0o700) }, false},
		{"new file", false, func(r string) error { return os.WriteFile(filepath.Join(r, "home/user/.x"), nil, 0o600) }, false},
		{"symlink target", false, func(r string) error {
			p := filepath.Join(r, "bin/alias")
			if err := os.Remove(p); err != nil {
				return err
			}
			if err := os.Symlink("tool2", p); err != nil {
				return err
			}
			// Keep the times so only the link target differs.
			return pinTimes(r, later)
		}, false},
		{"owner", true, func(r string) error { return os.Lchown(filepath.Join(r, "home/user"), 1000, 1000) }, false},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			if tc.root && os.Geteuid() != 0 {
				t.Skip("needs root (chown)")
			}
			r := smallTree(t)
			if err := pinTimes(r, later); err != nil {
				t.Fatal(err)
			}
			before := treeHash(t, r)
			if err := tc.change(r); err != nil {
				t.Fatal(err)
			}
			if after := treeHash(t, r); (after == before) != tc.same {
				t.Errorf("hash before %s, after %s: want same=%v", before, after, tc.same)
			}
		})
	}
}

// pinTimes sets the times of bin and bin/alias (not following the link).
func pinTimes(root string, at time.Time) error {
	ts := []unix.Timespec{unix.NsecToTimespec(at.UnixNano()), unix.NsecToTimespec(at.UnixNano())}
	for _, p := range []string{"bin/alias", "bin"} {
		if err := unix.UtimesNanoAt(unix.AT_FDCWD, filepath.Join(root, p), ts, unix.AT_SYMLINK_NOFOLLOW); err != nil {
			return err
		}
	}
	return nil
}

func TestTreeHashOfACopy(t *testing.T) {
	r := smallTree(t)
	cp := filepath.Join(t.TempDir(), "copy")
	if out, err := exec.Command("cp", "-a", r, cp).CombinedOutput(); err != nil {
		t.Fatalf("cp -a: %v: %s", err, out)
	}
	if a, b := treeHash(t, r), treeHash(t, cp); a != b {
		t.Errorf("a cp -a copy hashes differently: %s vs %s", a, b)
	}
}

func TestBuildBadInput(t *testing.T) {
	tree := smallTree(t)
	tests := []struct {
		name   string
		rootfs string
		sizeMB int
		path   string // PATH for the call
		want   error
	}{
		{"size too small", tree, 4, os.Getenv("PATH"), ErrInvalid},
		{"no such rootfs", filepath.Join(tree, "missing"), 64, os.Getenv("PATH"), ErrInvalid},
		{"rootfs is a file", filepath.Join(tree, "etc/hostname"), 64, os.Getenv("PATH"), ErrInvalid},
		{"no mkfs.ext4", tree, 64, t.TempDir(), image.ErrMissingTool},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			t.Setenv("PATH", tc.path)
			out := filepath.Join(t.TempDir(), "out")
			_, err := Build(context.Background(), tc.rootfs, out, tc.sizeMB)
			if !errors.Is(err, tc.want) {
				t.Fatalf("err = %v, want %v", err, tc.want)
			}
			// Nothing but the lock file may be left behind.
			ents, _ := os.ReadDir(out)
			for _, e := range ents {
				if e.Name() != ".lock" {
					t.Errorf("left behind: %s", e.Name())
				}
			}
		})
	}
}

func needMkfs(t testing.TB) {
	t.Helper()
	if _, err := exec.LookPath("mkfs.ext4"); err != nil {
		t.Skip("needs mkfs.ext4 (e2fsprogs)")
	}
}

// decode checks the artifact's shape: what sandboxes are launched on (catalog.DecodeLayers),
// plus our own fields.
func decode(t *testing.T, raw json.RawMessage) Artifact {
	t.Helper()
	var a Artifact
	if err := json.Unmarshal(raw, &a); err != nil {
		t.Fatal(err)
	}
	if a.Kind != ArtifactKind || a.Key == "" || len(a.Overlaybd.Layers) != 1 {
		t.Fatalf("artifact %s", raw)
	}
	ls, err := catalog.DecodeLayers(raw)
	if err != nil {
		t.Fatal(err)
	}
	if ls == nil || len(ls.Layers) != 1 || ls.Layers[0].Path != a.Overlaybd.Layers[0].Path || ls.SizeMB != a.Overlaybd.SizeMB {
		t.Fatalf("catalog.DecodeLayers(%s) = %+v", raw, ls)
	}
	return a
}

func TestBuildIsIdempotent(t *testing.T) {
	needMkfs(t)
	ctx := context.Background()
	tree := smallTree(t)
	out := filepath.Join(t.TempDir(), "layered")

	first, err := Build(ctx, tree, out, 32)
	if err != nil {
		t.Fatal(err)
	}
	if !first.Built {
		t.Error("first build reported as reused")
	}
	a := decode(t, first.Artifact)
	ref := a.Overlaybd.Layers[0]
	if a.Overlaybd.SizeMB != 32 || filepath.Dir(ref.Path) != out || ref.UUID == "" {
		t.Errorf("artifact %s", first.Artifact)
	}
	b, err := os.ReadFile(ref.Path)
	if err != nil {
		t.Fatal(err)
	}
	sum := sha256.Sum256(b)
	if ref.Digest != "sha256:"+hex.EncodeToString(sum[:]) || ref.Size != int64(len(b)) {
		t.Errorf("layer digest %s size %d, file has %x and %d bytes", ref.Digest, ref.Size, sum, len(b))
	}
	// The layer is compressed: far smaller than the 32 MiB image.
	if ref.Size >= 8<<20 {
		t.Errorf("layer of a tiny tree is %d bytes", ref.Size)
	}
	fi1, _ := os.Stat(ref.Path)

	again, err := Build(ctx, tree, out, 32)
	if err != nil {
		t.Fatal(err)
	}
	if again.Built || !bytes.Equal(again.Artifact, first.Artifact) {
		t.Errorf("second build: built=%v artifact %s, want the first's %s", again.Built, again.Artifact, first.Artifact)
	}
	if fi2, _ := os.Stat(ref.Path); !os.SameFile(fi1, fi2) {
		t.Error("the layer file was rewritten")
	}

	// A different size is a different layer.
	bigger, err := Build(ctx, tree, out, 48)
	if err != nil {
		t.Fatal(err)
	}
	if ab := decode(t, bigger.Artifact); !bigger.Built || ab.Key == a.Key || ab.Overlaybd.SizeMB != 48 {
		t.Errorf("size 48: built=%v %s", bigger.Built, bigger.Artifact)
	}

	// A damaged layer is rebuilt, under the same key.
	if err := os.Truncate(ref.Path, ref.Size/2); err != nil {
		t.Fatal(err)
	}
	fixed, err := Build(ctx, tree, out, 32)
	if err != nil {
		t.Fatal(err)
	}
	if af := decode(t, fixed.Artifact); !fixed.Built || af.Key != a.Key {
		t.Errorf("after truncation: built=%v %s", fixed.Built, fixed.Artifact)
	}

	// A changed tree gets a new layer; the old one stays (snapshots may still name it).
	if err := os.WriteFile(filepath.Join(tree, "etc/motd"), []byte("changed\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	changed, err := Build(ctx, tree, out, 32)
	if err != nil {
		t.Fatal(err)
	}
	ac := decode(t, changed.Artifact)
	if !changed.Built || ac.Key == a.Key || ac.Overlaybd.Layers[0].Path == ref.Path {
		t.Errorf("changed tree: built=%v %s", changed.Built, changed.Artifact)
	}
	if _, err := os.Stat(ref.Path); err != nil {
		t.Errorf("old layer removed: %v", err)
	}
	// No temporary files left.
	ents, _ := os.ReadDir(out)
	for _, e := range ents {
		if n := e.Name(); n != ".lock" && filepath.Ext(n) != ".zfile" && filepath.Ext(n) != ".json" {
			t.Errorf("left behind: %s", n)
		}
	}
}

func TestBuildCanceled(t *testing.T) {
	needMkfs(t)
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	out := filepath.Join(t.TempDir(), "layered")
	if _, err := Build(ctx, smallTree(t), out, 32); !errors.Is(err, context.Canceled) {
		t.Fatalf("err = %v, want context.Canceled", err)
	}
	ents, _ := os.ReadDir(out)
	for _, e := range ents {
		if e.Name() != ".lock" {
			t.Errorf("left behind: %s", e.Name())
		}
	}
}

// uid returns the owner of path.
func uid(t *testing.T, path string) int {
	t.Helper()
	fi, err := os.Lstat(path)
	if err != nil {
		t.Fatal(err)
	}
	return int(fi.Sys().(*syscall.Stat_t).Uid)
}
