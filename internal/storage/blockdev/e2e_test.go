package blockdev

import (
	"bytes"
	"context"
	"errors"
	"os"
	"os/exec"
	"path/filepath"
	"sync/atomic"
	"testing"

	"github.com/aenv-dev/aenv/internal/storage/lsmt"
	"github.com/aenv-dev/aenv/internal/storage/stack"
	"golang.org/x/sys/unix"
)

func requireRoot(t *testing.T) {
	t.Helper()
	if os.Geteuid() != 0 {
		t.Skip("needs root (FUSE direct mount, loop devices, ext4 mount)")
	}
	for _, p := range []string{"/dev/fuse", "/dev/loop-control"} {
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

func run(t *testing.T, name string, args ...string) {
	t.Helper()
	out, err := exec.Command(name, args...).CombinedOutput()
	if err != nil {
		t.Fatalf("%s %v: %v\n%s", name, args, err, out)
	}
	t.Logf("%s %v: %s", name, args, out)
}

// countingDev records which Device operations the kernel sent.
type countingDev struct {
	*stack.Stack
	discards, syncs atomic.Int64
}

func (c *countingDev) Discard(off, n int64) error { c.discards.Add(1); return c.Stack.Discard(off, n) }
func (c *countingDev) Sync() error                { c.syncs.Add(1); return c.Stack.Sync() }

// expose mounts the stack through FUSE, attaches a loop device and, unless
// noMount, mounts ext4 from it; cleanup is registered in reverse order.
func expose(t *testing.T, s Device, dir string, noMount bool) (loop *Loop, mnt string, done func()) {
	t.Helper()
	ex, err := Expose(context.Background(), dir, s, MountOptions{})
	if err != nil {
		t.Fatal(err)
	}
	l := ex.Loop
	mnt = filepath.Join(dir, "mnt")
	os.MkdirAll(mnt, 0o755)
	mounted := false
	closed := false
	done = func() {
		if closed {
			return
		}
		closed = true
		if mounted {
			if err := unix.Unmount(mnt, 0); err != nil {
				unix.Unmount(mnt, unix.MNT_DETACH)
				t.Errorf("umount ext4: %v", err)
			}
		}
		if err := ex.Close(); err != nil {
			t.Errorf("close exposed device: %v", err)
		}
	}
	t.Cleanup(done)
	if !noMount {
		run(t, "mount", "-t", "ext4", l.Path(), mnt)
		mounted = true
	}
	return l, mnt, done
}

// TestExt4EndToEnd: mkfs.ext4 -d → import → FUSE+loop → write → seal and
// restack → remount → fsck clean.
func TestExt4EndToEnd(t *testing.T) {
	requireRoot(t)
	ctx := context.Background()
	dir := t.TempDir()
	src := filepath.Join(dir, "src")
	os.MkdirAll(filepath.Join(src, "etc"), 0o755)
	payload := bytes.Repeat([]byte("hello overlaybd\n"), 100000)
	os.WriteFile(filepath.Join(src, "etc", "motd"), payload, 0o644)
	img := filepath.Join(dir, "rootfs.img")
	run(t, "mkfs.ext4", "-q", "-F", "-d", src, img, "64M")

	f, _ := os.Open(img)
	lp := filepath.Join(dir, "base.commit")
	out, _ := os.Create(lp)
	if _, err := lsmt.Import(out, f, lsmt.CommitOptions{}); err != nil {
		t.Fatal(err)
	}
	f.Close()
	out.Close()

	man := &stack.Manifest{Dir: dir, Lowers: []stack.LayerRef{{Path: "base.commit"}},
		Upper: &stack.Upper{Data: "upper.data", Index: "upper.index"}}
	s, err := stack.Open(ctx, man, stack.Options{})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { s.Close() })

	dev := &countingDev{Stack: s}
	_, mnt, done := expose(t, dev, dir, false)
	got, err := os.ReadFile(filepath.Join(mnt, "etc", "motd"))
	if err != nil || !bytes.Equal(got, payload) {
		t.Fatalf("read back: %v", err)
	}
	newData := bytes.Repeat([]byte{0xA5}, 3<<20)
	if err := os.WriteFile(filepath.Join(mnt, "new.bin"), newData, 0o644); err != nil {
		t.Fatal(err)
	}
	os.Remove(filepath.Join(mnt, "etc", "motd"))
	run(t, "fstrim", mnt)
	// syncfs of this filesystem only: a global sync would wait on every filesystem of the
	// host, including ones wedged by someone else's dead FUSE server.
	run(t, "sync", "-f", mnt)
	done()
	if dev.discards.Load() == 0 || dev.syncs.Load() == 0 {
		t.Fatalf("kernel sent %d discards and %d syncs; want both", dev.discards.Load(), dev.syncs.Load())
	}

	if _, err := s.SealAndRestack(ctx, filepath.Join(dir, "snap1.sealed")); err != nil {
		t.Fatal(err)
	}
	if s.Depth() != 2 {
		t.Fatalf("depth %d", s.Depth())
	}

	loop, _, done2 := expose(t, s, dir, true)
	run(t, "fsck.ext4", "-n", "-f", loop.Path())
	done2()

	_, mnt, done3 := expose(t, s, dir, false)
	got, err = os.ReadFile(filepath.Join(mnt, "new.bin"))
	if err != nil || !bytes.Equal(got, newData) {
		t.Fatalf("after restack: %v", err)
	}
	if _, err := os.Stat(filepath.Join(mnt, "etc", "motd")); !os.IsNotExist(err) {
		t.Fatalf("deleted file back: %v", err)
	}
	// Live snapshot: freeze, restack while mounted, thaw, keep writing.
	os.WriteFile(filepath.Join(mnt, "second.txt"), []byte("second"), 0o644)
	thaw, err := Freeze(mnt)
	if err != nil {
		t.Fatal(err)
	}
	snap, err := s.SealAndRestack(ctx, filepath.Join(dir, "snap2.sealed"))
	if err := errors.Join(err, thaw()); err != nil {
		t.Fatal(err)
	}
	os.WriteFile(filepath.Join(mnt, "third.txt"), []byte("third"), 0o644)
	done3()
	// The snapshot's lowers alone hold second.txt but not third.txt.
	snapStack, err := stack.Open(ctx, &stack.Manifest{Dir: dir, Lowers: []stack.LayerRef{{Path: "base.commit"}, {Path: "snap1.sealed"}, {Path: snap.Path}},
		Upper: &stack.Upper{Data: "fork.data", Index: "fork.index"}}, stack.Options{})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { snapStack.Close() })
	forkDir := filepath.Join(dir, "fork")
	loop, _, done5 := expose(t, snapStack, forkDir, true)
	run(t, "fsck.ext4", "-n", "-f", loop.Path())
	done5()
	_, forkMnt, done6 := expose(t, snapStack, forkDir, false)
	if b, err := os.ReadFile(filepath.Join(forkMnt, "second.txt")); err != nil || string(b) != "second" {
		t.Fatalf("snapshot lacks second.txt: %v", err)
	}
	if _, err := os.Stat(filepath.Join(forkMnt, "third.txt")); !os.IsNotExist(err) {
		t.Fatalf("snapshot has a file written after it: %v", err)
	}
	done6()

	// Read-only: lowers only, no upper, mounted ro.
	ro, err := stack.Open(ctx, &stack.Manifest{Dir: dir, Lowers: []stack.LayerRef{{Path: "base.commit"}, {Path: "snap1.sealed"}, {Path: snap.Path}}}, stack.Options{})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { ro.Close() })
	ex, err := Expose(ctx, filepath.Join(dir, "ro"), ro, MountOptions{ReadOnly: true})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { ex.Close() })
	roMnt := filepath.Join(dir, "ro", "mnt")
	os.MkdirAll(roMnt, 0o755)
	run(t, "mount", "-t", "ext4", "-o", "ro,noload", ex.Device(), roMnt)
	b, err := os.ReadFile(filepath.Join(roMnt, "second.txt"))
	werr := os.WriteFile(filepath.Join(roMnt, "x"), []byte("x"), 0o644)
	if uerr := unix.Unmount(roMnt, 0); uerr != nil {
		t.Errorf("umount ro: %v", uerr)
	}
	if err != nil || string(b) != "second" || werr == nil {
		t.Fatalf("read-only mount: read %v, write %v", err, werr)
	}
	if err := ex.Close(); err != nil {
		t.Fatal(err)
	}
	loop, _, done4 := expose(t, s, dir, true)
	run(t, "fsck.ext4", "-n", "-f", loop.Path())
	done4()
}

func TestSweep(t *testing.T) {
	requireRoot(t)
	ctx := context.Background()
	dir := t.TempDir()
	s, err := stack.Open(ctx, &stack.Manifest{Dir: dir, VirtualSize: 16 << 20,
		Upper: &stack.Upper{Data: "u.data", Index: "u.index"}}, stack.Options{})
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	m, err := MountFile(ctx, filepath.Join(dir, "fuse"), s, MountOptions{})
	if err != nil {
		t.Fatal(err)
	}
	l, err := AttachLoop(ctx, m.Path(), false)
	if err != nil {
		m.Close()
		t.Fatal(err)
	}
	// Simulate a crash: forget the handles and let Sweep clean up. The loop's
	// fd is still held here, so drop autoclear's reliance on it first.
	loopDev := l.Path()
	if err := Sweep(ctx, dir); err != nil {
		t.Logf("sweep: %v", err)
	}
	l.f.Close()
	m.server.Wait()
	mounts, _ := fuseMounts(dir)
	if len(mounts) != 0 {
		t.Fatalf("mounts left: %v", mounts)
	}
	if b, err := os.ReadFile("/sys/block/" + filepath.Base(loopDev) + "/loop/backing_file"); err == nil && bytes.Contains(b, []byte(dir)) {
		t.Fatalf("loop %s still attached to %s", loopDev, b)
	}
}
