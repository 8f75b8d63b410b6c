package rootfs

import (
	"bytes"
	"context"
	"errors"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/aenv-dev/aenv/internal/storage/blockdev"
	"github.com/aenv-dev/aenv/internal/storage/lsmt"
	"github.com/aenv-dev/aenv/internal/storage/stack"
	"golang.org/x/sys/unix"
)

func needBlock(t testing.TB) {
	t.Helper()
	if os.Geteuid() != 0 {
		t.Skip("needs root (FUSE, loop devices, ext4 mounts)")
	}
	for _, p := range []string{"/dev/fuse", "/dev/loop-control"} {
		if _, err := os.Stat(p); err != nil {
			t.Skipf("needs %s", p)
		}
	}
	for _, tool := range []string{"mkfs.ext4", "resize2fs", "fsck.ext4"} {
		if _, err := exec.LookPath(tool); err != nil {
			t.Skipf("needs %s (e2fsprogs)", tool)
		}
	}
}

// baseLayer makes a sealed layer holding an ext4 filesystem of sizeMB built from files.
func baseLayer(t testing.TB, dir string, sizeMB int, files map[string]string) stack.LayerRef {
	t.Helper()
	src := filepath.Join(dir, "src")
	for name, body := range files {
		p := filepath.Join(src, name)
		if err := os.MkdirAll(filepath.Dir(p), 0o755); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(p, []byte(body), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	img := filepath.Join(dir, "base.img")
	if out, err := exec.Command("mkfs.ext4", "-q", "-F", "-E", "root_owner=0:0", "-d", src, img, strconv.Itoa(sizeMB)+"M").CombinedOutput(); err != nil {
		t.Fatalf("mkfs.ext4: %v: %s", err, out)
	}
	raw, err := os.Open(img)
	if err != nil {
		t.Fatal(err)
	}
	defer raw.Close()
	path := filepath.Join(dir, "base.commit")
	out, err := os.Create(path)
	if err != nil {
		t.Fatal(err)
	}
	info, err := lsmt.Import(out, raw, lsmt.CommitOptions{})
	if cerr := out.Close(); err == nil {
		err = cerr
	}
	if err != nil {
		t.Fatal(err)
	}
	os.Remove(img)
	return stack.LayerRef{Path: path, Size: info.Size, UUID: info.UUID}
}

// open opens a block root and closes it when the test ends.
func open(t testing.TB, spec Spec) *Block {
	t.Helper()
	if spec.UserNS == 0 {
		spec.UserNS = -1
	}
	b, err := Open(context.Background(), spec)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if err := b.Close(); err != nil {
			t.Errorf("close: %v", err)
		}
	})
	return b
}

func TestSnapshotAndFork(t *testing.T) {
	needBlock(t)
	ctx := context.Background()
	dir := t.TempDir()
	base := baseLayer(t, dir, 64, map[string]string{"etc/hello": "hello\n"})

	a := open(t, Spec{Dir: filepath.Join(dir, "a"), Lowers: []stack.LayerRef{base}, Target: filepath.Join(dir, "a", "root")})
	mnt := filepath.Join(dir, "a", "root")
	if b, err := os.ReadFile(filepath.Join(mnt, "etc/hello")); err != nil || string(b) != "hello\n" {
		t.Fatalf("template file: %q %v", b, err)
	}
	big := bytes.Repeat([]byte{0x5a}, 3<<20)
	if err := os.WriteFile(filepath.Join(mnt, "one"), big, 0o644); err != nil {
		t.Fatal(err)
	}
	lowers, times, err := a.Snapshot(ctx, filepath.Join(dir, "layers", "snap1.commit"), QuiesceFreeze)
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("snapshot: %+v", times)
	if len(lowers) != 2 || lowers[1].Path != filepath.Join(dir, "layers", "snap1.commit") {
		t.Fatalf("lowers %+v", lowers)
	}
	// The source keeps running on a fresh upper.
	if err := os.WriteFile(filepath.Join(mnt, "two"), []byte("after"), 0o644); err != nil {
		t.Fatal(err)
	}
	var kids []string
	for _, name := range []string{"k1", "k2"} {
		k := open(t, Spec{Dir: filepath.Join(dir, name), Lowers: lowers, Target: filepath.Join(dir, name, "root")})
		root := filepath.Join(dir, name, "root")
		got, err := os.ReadFile(filepath.Join(root, "one"))
		if err != nil || !bytes.Equal(got, big) {
			t.Fatalf("%s: snapshot file: %v", name, err)
		}
		if _, err := os.Stat(filepath.Join(root, "two")); !errors.Is(err, os.ErrNotExist) {
			t.Fatalf("%s sees the source's later write: %v", name, err)
		}
		if err := os.WriteFile(filepath.Join(root, "mine"), []byte(name), 0o644); err != nil {
			t.Fatal(err)
		}
		if k.UpperBytes() == 0 {
			t.Fatalf("%s: upper is empty after a write", name)
		}
		kids = append(kids, root)
	}
	if b, _ := os.ReadFile(filepath.Join(kids[0], "mine")); string(b) != "k1" {
		t.Fatalf("k1 sees %q", b)
	}
	if _, err := os.Stat(filepath.Join(mnt, "mine")); !errors.Is(err, os.ErrNotExist) {
		t.Fatalf("source sees a child's write: %v", err)
	}
}

func TestGrow(t *testing.T) {
	needBlock(t)
	dir := t.TempDir()
	base := baseLayer(t, dir, 32, map[string]string{"f": "x"})
	b := open(t, Spec{Dir: filepath.Join(dir, "s"), Lowers: []stack.LayerRef{base}, VirtualSize: 96 << 20, Target: filepath.Join(dir, "s", "root")})
	var st unix.Statfs_t
	if err := unix.Statfs(filepath.Join(dir, "s", "root"), &st); err != nil {
		t.Fatal(err)
	}
	if total := st.Blocks * uint64(st.Bsize); total < 80<<20 {
		t.Fatalf("filesystem is %d bytes after growing to 96 MiB", total)
	}
	if b.Size() != 96<<20 {
		t.Fatalf("device %d bytes", b.Size())
	}
	// The loop device's dirty limit applies while mounted and is undone at Close (loop
	// devices are reused).
	bdi := filepath.Join("/sys/class/bdi", "7:"+strings.TrimPrefix(b.Device(), "/dev/loop"))
	if v, _ := os.ReadFile(filepath.Join(bdi, "strict_limit")); strings.TrimSpace(string(v)) != "1" {
		t.Fatalf("strict_limit %q while mounted", v)
	}
	// Undo it while the device is still ours (once detached, a parallel test may take it).
	if err := b.undirty(); err != nil {
		t.Fatal(err)
	}
	b.undirty = nil
	if v, _ := os.ReadFile(filepath.Join(bdi, "strict_limit")); strings.TrimSpace(string(v)) != "0" {
		t.Fatalf("strict_limit %q after the restore", v)
	}
}

// TestSweep drops an open root without closing it (as a crash does) and checks Sweep
// leaves no ext4 mount, loop device or FUSE mount.
func TestSweep(t *testing.T) {
	needBlock(t)
	dir := t.TempDir()
	base := baseLayer(t, dir, 32, map[string]string{"f": "x"})
	target := filepath.Join(dir, "s", "root")
	b, err := Open(context.Background(), Spec{Dir: filepath.Join(dir, "s"), Lowers: []stack.LayerRef{base}, Target: target, UserNS: -1})
	if err != nil {
		t.Fatal(err)
	}
	dev := b.Device()
	if err := Sweep(context.Background(), dir); err != nil {
		t.Logf("sweep: %v", err) // a busy loop is marked autoclear and reported
	}
	// The handles of the "crashed" owner go away last (in a crash, with the process).
	b.ex.Loop.Detach()
	b.ex.Mount.Close()
	b.st.Close()
	if raw, err := os.ReadFile("/proc/self/mountinfo"); err == nil && strings.Contains(string(raw), dir) {
		t.Fatalf("mounts left under %s", dir)
	}
	if bf, err := os.ReadFile(filepath.Join("/sys/block", filepath.Base(dev), "loop", "backing_file")); err == nil && strings.Contains(string(bf), dir) {
		t.Fatalf("loop %s still attached to %s", dev, bf)
	}
}

// TestSnapshotUnderWrites snapshots while a writer creates files, in both quiesce modes:
// every file finished before the snapshot began is complete in a root opened from the
// snapshot, and the filesystem checks clean (after the journal replay the mount does).
func TestSnapshotUnderWrites(t *testing.T) {
	for _, q := range []struct {
		name string
		q    Quiesce
	}{{"freeze", QuiesceFreeze}, {"sync", QuiesceSync}} {
		t.Run(q.name, func(t *testing.T) { testSnapshotUnderWrites(t, q.q) })
	}
}

func testSnapshotUnderWrites(t *testing.T, q Quiesce) {
	needBlock(t)
	ctx := context.Background()
	dir := t.TempDir()
	base := baseLayer(t, dir, 128, map[string]string{"f": "x"})
	mnt := filepath.Join(dir, "a", "root")
	a := open(t, Spec{Dir: filepath.Join(dir, "a"), Lowers: []stack.LayerRef{base}, Target: mnt})
	body := func(n int) []byte { return bytes.Repeat([]byte(strconv.Itoa(n)+"\n"), 2000+n) }
	stop := make(chan struct{})
	done := make(chan int)
	var mu sync.Mutex
	written := 0 // files fully written (write + close returned)
	go func() {
		n := 0
		for {
			select {
			case <-stop:
				done <- n
				return
			default:
			}
			if err := os.WriteFile(filepath.Join(mnt, "w"+strconv.Itoa(n)), body(n), 0o644); err != nil {
				t.Error(err)
				done <- n
				return
			}
			n++
			mu.Lock()
			written = n
			mu.Unlock()
		}
	}()
	for {
		mu.Lock()
		w := written
		mu.Unlock()
		if w >= 200 {
			break
		}
		time.Sleep(time.Millisecond)
	}
	mu.Lock()
	before := written
	mu.Unlock()
	lowers, times, err := a.Snapshot(ctx, filepath.Join(dir, "layers", "s.commit"), q)
	close(stop)
	total := <-done
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("%d files before the snapshot, %d in all; %+v", before, total, times)
	kdir := filepath.Join(dir, "k")
	k := open(t, Spec{Dir: kdir, Lowers: lowers, Target: filepath.Join(kdir, "root")})
	for n := 0; n < before; n++ {
		got, err := os.ReadFile(filepath.Join(kdir, "root", "w"+strconv.Itoa(n)))
		if err != nil || !bytes.Equal(got, body(n)) {
			t.Fatalf("file %d of %d written before the snapshot: %d bytes, %v", n, before, len(got), err)
		}
	}
	if err := k.Close(); err != nil {
		t.Fatal(err)
	}
	// fsck the child's device (lowers + the upper it wrote during its mount).
	st, err := stack.Open(ctx, &stack.Manifest{Dir: kdir, Lowers: lowers, Upper: &stack.Upper{Data: upperData, Index: upperIndex}}, stack.Options{})
	if err != nil {
		t.Fatal(err)
	}
	defer st.Close()
	ex, err := blockdev.Expose(ctx, filepath.Join(kdir, "fsck"), st, blockdev.MountOptions{ReadOnly: true})
	if err != nil {
		t.Fatal(err)
	}
	out, ferr := exec.Command("fsck.ext4", "-n", "-f", ex.Device()).CombinedOutput()
	if err := ex.Close(); err != nil {
		t.Error(err)
	}
	if ferr != nil {
		t.Fatalf("fsck: %v\n%s", ferr, out)
	}
}
