package layered

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/aenv-dev/aenv/internal/storage/blockdev"
	"github.com/aenv-dev/aenv/internal/storage/stack"
	"github.com/aenv-dev/aenv/internal/template/base"
)

func requireRoot(t *testing.T) {
	t.Helper()
	if os.Geteuid() != 0 {
		t.Skip("needs root (FUSE direct mount, loop devices, ext4 mount)")
	}
	for _, p := range []string{"/dev/fuse", "/dev/loop-control", "/bin/busybox", "/bin/bash-static"} {
		if _, err := os.Stat(p); err != nil {
			t.Skipf("needs %s", p)
		}
	}
	for _, tool := range []string{"mkfs.ext4", "fsck.ext4"} {
		if _, err := exec.LookPath(tool); err != nil {
			t.Skipf("needs %s (e2fsprogs)", tool)
		}
	}
}

// TestBaseLayerMounts builds the real base rootfs, converts it, and reads it back the way
// a sandbox's root does: the manifest's stack exposed through FUSE + loop, fsck-clean,
// mounted as ext4 (read-only here), with the files the SDKs rely on.
func TestBaseLayerMounts(t *testing.T) {
	requireRoot(t)
	ctx := context.Background()
	tmp := t.TempDir()
	dir := filepath.Join(tmp, "rootfs")
	if err := base.Build(ctx, base.Options{Out: dir}); err != nil {
		t.Fatal(err)
	}
	res, err := Build(ctx, dir, filepath.Join(tmp, "layered"), 256)
	if err != nil {
		t.Fatal(err)
	}
	var a Artifact
	if err := json.Unmarshal(res.Artifact, &a); err != nil {
		t.Fatal(err)
	}
	t.Logf("base layer: %d bytes, built in %v", a.Overlaybd.Layers[0].Size, res.Elapsed)

	m, err := stack.LoadManifest(res.Manifest)
	if err != nil {
		t.Fatal(err)
	}
	st, err := stack.Open(ctx, m, stack.Options{})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if err := st.Close(); err != nil {
			t.Errorf("close stack: %v", err)
		}
	})
	if st.Size() != 256<<20 {
		t.Errorf("stack size %d, want %d", st.Size(), 256<<20)
	}
	ex, err := blockdev.Expose(ctx, filepath.Join(tmp, "blk"), st, blockdev.MountOptions{ReadOnly: true})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if err := ex.Close(); err != nil {
			t.Errorf("close exposed device: %v", err)
		}
	})
	if out, err := exec.Command("fsck.ext4", "-n", "-f", ex.Device()).CombinedOutput(); err != nil {
		t.Fatalf("fsck.ext4 -n -f %s: %v\n%s", ex.Device(), err, out)
	}
	mnt := filepath.Join(tmp, "mnt")
	if err := os.Mkdir(mnt, 0o755); err != nil {
		t.Fatal(err)
	}
	if err := unix.Mount(ex.Device(), mnt, "ext4", unix.MS_RDONLY, "noload"); err != nil {
		t.Fatalf("mount %s: %v", ex.Device(), err)
	}
	// Cleanups run last-in first-out: this unmount runs before the device is closed.
	t.Cleanup(func() {
		if err := unix.Unmount(mnt, 0); err != nil {
			unix.Unmount(mnt, unix.MNT_DETACH)
			t.Errorf("unmount: %v", err)
		}
	})

	tests := []struct {
		path string
		dir  bool
		uid  int
	}{
		{"bin/bash", false, 0},
		{"bin/busybox", false, 0},
		{"home/user", true, base.UserUID},
		{"etc/passwd", false, 0},
		{base.StampFile, false, 0},
		{base.EnvdMountpoint[1:], false, 0},
	}
	for _, tc := range tests {
		t.Run(tc.path, func(t *testing.T) {
			p := filepath.Join(mnt, tc.path)
			fi, err := os.Stat(p)
			if err != nil {
				t.Fatal(err)
			}
			if fi.IsDir() != tc.dir {
				t.Errorf("dir = %v, want %v", fi.IsDir(), tc.dir)
			}
			if got := uid(t, p); got != tc.uid {
				t.Errorf("uid %d, want %d", got, tc.uid)
			}
			if tc.dir {
				return
			}
			want, err := os.ReadFile(filepath.Join(dir, tc.path))
			if err != nil {
				t.Fatal(err)
			}
			got, err := os.ReadFile(p)
			if err != nil {
				t.Fatal(err)
			}
			if !bytes.Equal(got, want) {
				t.Errorf("content differs from the source tree (%d vs %d bytes)", len(got), len(want))
			}
		})
	}
	if fi, err := os.Stat(filepath.Join(mnt, "bin/bash")); err == nil && fi.Mode()&0o111 == 0 {
		t.Errorf("/bin/bash mode %v is not executable", fi.Mode())
	}
	// Sandboxes write to their own upper, never to the shared layer.
	if err := os.WriteFile(filepath.Join(mnt, "home/user/x"), nil, 0o644); !errors.Is(err, unix.EROFS) {
		t.Errorf("write to the read-only mount: %v, want EROFS", err)
	}
}

// leftovers lists mounts and loop devices whose path or backing file lies under dir.
func leftovers(t *testing.T, dir string) []string {
	t.Helper()
	var found []string
	mi, err := os.ReadFile("/proc/self/mountinfo")
	if err != nil {
		t.Fatal(err)
	}
	for _, line := range strings.Split(string(mi), "\n") {
		if f := strings.Fields(line); len(f) > 4 && strings.HasPrefix(f[4], dir) {
			found = append(found, "mount "+f[4])
		}
	}
	backs, _ := filepath.Glob("/sys/block/loop*/loop/backing_file")
	for _, bf := range backs {
		if b, err := os.ReadFile(bf); err == nil && strings.HasPrefix(string(b), dir) {
			found = append(found, "loop "+strings.TrimSpace(string(b)))
		}
	}
	return found
}

func TestVerify(t *testing.T) {
	requireRoot(t)
	ctx := context.Background()
	tmp := t.TempDir()
	tree := smallTree(t)
	good, err := Build(ctx, tree, filepath.Join(tmp, "good"), 32)
	if err != nil {
		t.Fatal(err)
	}
	// A valid layer stack whose device is all zeros: no filesystem on it.
	zeros := filepath.Join(tmp, "zeros.raw")
	if err := os.WriteFile(zeros, nil, 0o644); err != nil {
		t.Fatal(err)
	}
	if err := os.Truncate(zeros, 16<<20); err != nil {
		t.Fatal(err)
	}
	info, err := importCompressed(zeros, filepath.Join(tmp, "zeros.zfile"))
	if err != nil {
		t.Fatal(err)
	}
	ref, err := describe(filepath.Join(tmp, "zeros.zfile"), info.UUID)
	if err != nil {
		t.Fatal(err)
	}
	ref.Path = filepath.Join(tmp, "zeros.zfile")
	empty := filepath.Join(tmp, "zeros.stack.json")
	if err := writeJSON(empty, stack.Manifest{Lowers: []stack.LayerRef{ref}}); err != nil {
		t.Fatal(err)
	}

	tests := []struct {
		name     string
		manifest string
		want     error // nil: success
		anyErr   bool
	}{
		{"base layer", good.Manifest, nil, false},
		{"no filesystem", empty, ErrNotExt4, true},
		{"no manifest", filepath.Join(tmp, "missing.stack.json"), nil, true},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			work := filepath.Join(tmp, "verify-"+strings.ReplaceAll(tc.name, " ", "-"))
			err := Verify(ctx, tc.manifest, work)
			if (err != nil) != tc.anyErr || (tc.want != nil && !errors.Is(err, tc.want)) {
				t.Fatalf("Verify = %v, want %v (any error: %v)", err, tc.want, tc.anyErr)
			}
			if left := leftovers(t, work); len(left) > 0 {
				t.Fatalf("left behind: %v", left)
			}
		})
	}
}

// TestVerifyOnce: a passed Verify is remembered for the same manifest and layer files
// (a second call does not mount: it passes even where mounting would fail), and a layer
// that changed is verified again.
func TestVerifyOnce(t *testing.T) {
	requireRoot(t)
	ctx := context.Background()
	tmp := t.TempDir()
	res, err := Build(ctx, smallTree(t), filepath.Join(tmp, "out"), 32)
	if err != nil {
		t.Fatal(err)
	}
	if err := VerifyOnce(ctx, res.Manifest, filepath.Join(tmp, "work")); err != nil {
		t.Fatal(err)
	}
	// A work dir that is a file: any real Verify fails from now on.
	blocked := filepath.Join(tmp, "blocked")
	if err := os.WriteFile(blocked, nil, 0o644); err != nil {
		t.Fatal(err)
	}
	if err := VerifyOnce(ctx, res.Manifest, blocked); err != nil {
		t.Fatalf("VerifyOnce of an unchanged, verified stack checked again: %v", err)
	}
	m, err := stack.LoadManifest(res.Manifest)
	if err != nil {
		t.Fatal(err)
	}
	later := time.Now().Add(time.Minute)
	if err := os.Chtimes(m.Lowers[0].Path, later, later); err != nil {
		t.Fatal(err)
	}
	if err := VerifyOnce(ctx, res.Manifest, blocked); err == nil {
		t.Fatal("VerifyOnce after the layer changed did not verify again")
	}
	// The failed check forgot the stamp: the next call verifies too.
	if err := VerifyOnce(ctx, res.Manifest, blocked); err == nil {
		t.Fatal("VerifyOnce after a failed Verify passed without checking")
	}
	if err := VerifyOnce(ctx, res.Manifest, filepath.Join(tmp, "work")); err != nil {
		t.Fatal(err)
	}
}
