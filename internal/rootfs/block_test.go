package rootfs

import (
	"bytes"
	"context"
	"errors"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
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
	for _, tool := range []string{"mkfs.ext4", "resize2fs", "fsck.ext4", "dumpe2fs"} {
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
	return treeLayer(t, dir, "base", src, sizeMB)
}

// treeLayer makes dir/name.commit, a sealed layer holding an ext4 filesystem of sizeMB
// built from the directory tree src.
func treeLayer(t testing.TB, dir, name, src string, sizeMB int) stack.LayerRef {
	t.Helper()
	img := filepath.Join(dir, name+".img")
	if out, err := exec.Command("mkfs.ext4", "-q", "-F", "-E", "root_owner=0:0", "-d", src, img, strconv.Itoa(sizeMB)+"M").CombinedOutput(); err != nil {
		t.Fatalf("mkfs.ext4: %v: %s", err, out)
	}
	defer os.Remove(img)
	raw, err := os.Open(img)
	if err != nil {
		t.Fatal(err)
	}
	defer raw.Close()
	path := filepath.Join(dir, name+".commit")
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
	if _, err := os.Stat(filepath.Join(dir, "a", expeditedMarker)); !os.IsNotExist(err) {
		t.Fatalf("expedited-RCU marker left after the snapshot: %v", err)
	}
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
	// The loop device reads and writes the FUSE file directly (one page cache, not two).
	if v, err := os.ReadFile(filepath.Join("/sys/block", filepath.Base(b.Device()), "loop", "dio")); err != nil || strings.TrimSpace(string(v)) != "1" {
		t.Fatalf("loop direct I/O %q (%v), want 1", v, err)
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

// TestLoopNotHeld checks that a mounted root leaves no descriptor on its loop device in
// this process (every child the node starts would copy it and close it again at exec),
// and that Close still leaves the device detached: the unmount lets autoclear do it.
func TestLoopNotHeld(t *testing.T) {
	needBlock(t)
	dir := t.TempDir()
	base := baseLayer(t, dir, 32, map[string]string{"f": "x"})
	target := filepath.Join(dir, "s", "root")
	b, err := Open(context.Background(), Spec{Dir: filepath.Join(dir, "s"), Lowers: []stack.LayerRef{base}, Target: target, UserNS: -1})
	if err != nil {
		t.Fatal(err)
	}
	dev := b.Device()
	fds, err := os.ReadDir("/proc/self/fd")
	if err != nil {
		t.Fatal(err)
	}
	for _, fd := range fds {
		if l, _ := os.Readlink(filepath.Join("/proc/self/fd", fd.Name())); l == dev {
			t.Errorf("fd %s holds %s after Open", fd.Name(), dev)
		}
	}
	if err := os.WriteFile(filepath.Join(target, "f2"), []byte("y"), 0o644); err != nil {
		t.Fatal(err)
	}
	if err := b.Close(); err != nil {
		t.Fatal(err)
	}
	if bf, err := os.ReadFile(filepath.Join("/sys/block", filepath.Base(dev), "loop", "backing_file")); err == nil && strings.Contains(string(bf), dir) {
		t.Fatalf("loop %s still attached to %s after Close", dev, bf)
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
	b.loop.Detach()
	b.disk.Close()
	if raw, err := os.ReadFile("/proc/self/mountinfo"); err == nil && strings.Contains(string(raw), dir) {
		t.Fatalf("mounts left under %s", dir)
	}
	if bf, err := os.ReadFile(filepath.Join("/sys/block", filepath.Base(dev), "loop", "backing_file")); err == nil && strings.Contains(string(bf), dir) {
		t.Fatalf("loop %s still attached to %s", dev, bf)
	}
}

// TestSnapshotUnderWrites snapshots during a heavy write loop, in both quiesce modes:
// one writer creates small files, another streams 1 MiB writes into a large file. Every
// file finished before the snapshot began is complete in a root opened from the
// snapshot, and so is every byte of the stream written before it began; the filesystem
// checks clean: a freeze's image as it was sealed (no journal to replay), a sync's after
// the mount replayed its journal.
func TestSnapshotUnderWrites(t *testing.T) {
	for _, q := range []struct {
		name string
		q    Quiesce
	}{{"freeze", QuiesceFreeze}, {"sync", QuiesceSync}} {
		t.Run(q.name, func(t *testing.T) { testSnapshotUnderWrites(t, q.q) })
	}
}

// streamChunk is the stream writer's n-th 1 MiB block.
func streamChunk(n int) []byte {
	b := bytes.Repeat([]byte{byte(n), byte(n >> 8), 0x5a, 0xa5}, 1<<18)
	return b
}

func testSnapshotUnderWrites(t *testing.T, q Quiesce) {
	needBlock(t)
	ctx := context.Background()
	dir := t.TempDir()
	base := baseLayer(t, dir, 64, map[string]string{"f": "x"})
	mnt := filepath.Join(dir, "a", "root")
	a := open(t, Spec{Dir: filepath.Join(dir, "a"), Lowers: []stack.LayerRef{base}, VirtualSize: 512 << 20, Target: mnt})
	body := func(n int) []byte { return bytes.Repeat([]byte(strconv.Itoa(n)+"\n"), 2000+n) }
	stop := make(chan struct{})
	var wg sync.WaitGroup
	var files, chunks atomic.Int64 // files and stream chunks fully written (the call returned)
	wg.Add(2)
	go func() {
		defer wg.Done()
		for n := 0; ; n++ {
			select {
			case <-stop:
				return
			default:
			}
			if err := os.WriteFile(filepath.Join(mnt, "w"+strconv.Itoa(n)), body(n), 0o644); err != nil {
				t.Error(err)
				return
			}
			files.Store(int64(n + 1))
		}
	}()
	go func() {
		defer wg.Done()
		f, err := os.Create(filepath.Join(mnt, "stream"))
		if err != nil {
			t.Error(err)
			return
		}
		defer f.Close()
		// Up to 256 MiB: far more than the root may hold dirty (MaxDirty).
		for n := 0; n < 256; n++ {
			select {
			case <-stop:
				return
			default:
			}
			if _, err := f.Write(streamChunk(n)); err != nil {
				t.Error(err)
				return
			}
			chunks.Store(int64(n + 1))
		}
	}()
	for files.Load() < 200 || chunks.Load() < 64 {
		time.Sleep(time.Millisecond)
	}
	beforeFiles, beforeChunks := int(files.Load()), int(chunks.Load())
	lowers, times, err := a.Snapshot(ctx, filepath.Join(dir, "layers", "s.commit"), q)
	close(stop)
	wg.Wait()
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("%d files and %d MiB before the snapshot, %d and %d in all; %+v", beforeFiles, beforeChunks, files.Load(), chunks.Load(), times)

	if q == QuiesceFreeze {
		// The sealed image itself, read-only, before anything mounted it.
		fsck(t, ctx, filepath.Join(dir, "sealed"), lowers, false)
	}
	kdir := filepath.Join(dir, "k")
	k := open(t, Spec{Dir: kdir, Lowers: lowers, Target: filepath.Join(kdir, "root")})
	for n := 0; n < beforeFiles; n++ {
		got, err := os.ReadFile(filepath.Join(kdir, "root", "w"+strconv.Itoa(n)))
		if err != nil || !bytes.Equal(got, body(n)) {
			t.Fatalf("file %d of %d written before the snapshot: %d bytes, %v", n, beforeFiles, len(got), err)
		}
	}
	sf, err := os.Open(filepath.Join(kdir, "root", "stream"))
	if err != nil {
		t.Fatal(err)
	}
	got := make([]byte, 1<<20)
	for n := 0; n < beforeChunks; n++ {
		if _, err := io.ReadFull(sf, got); err != nil || !bytes.Equal(got, streamChunk(n)) {
			sf.Close()
			t.Fatalf("stream MiB %d of %d written before the snapshot: %v", n, beforeChunks, err)
		}
	}
	sf.Close()
	if err := k.Close(); err != nil {
		t.Fatal(err)
	}
	// The child's device (lowers + the upper it wrote during its mount).
	fsck(t, ctx, kdir, lowers, true)
}

// fsck checks the ext4 filesystem on lowers (plus dir's upper when withUpper), read-only.
func fsck(t *testing.T, ctx context.Context, dir string, lowers []stack.LayerRef, withUpper bool) {
	t.Helper()
	m := &stack.Manifest{Dir: dir, Lowers: lowers}
	if withUpper {
		m.Upper = &stack.Upper{Data: "upper.data", Index: "upper.index"}
	}
	st, err := stack.Open(ctx, m, stack.Options{})
	if err != nil {
		t.Fatal(err)
	}
	defer st.Close()
	ex, err := blockdev.Expose(ctx, filepath.Join(dir, "fsck"), st, blockdev.MountOptions{ReadOnly: true})
	if err != nil {
		t.Fatal(err)
	}
	out, ferr := exec.Command("fsck.ext4", "-n", "-f", ex.Device()).CombinedOutput()
	// A frozen image has its journal flushed: nothing for a mount to replay.
	sb, derr := exec.Command("dumpe2fs", "-h", ex.Device()).CombinedOutput()
	if err := ex.Close(); err != nil {
		t.Error(err)
	}
	if ferr != nil {
		t.Fatalf("fsck: %v\n%s", ferr, out)
	}
	if derr != nil {
		t.Fatalf("dumpe2fs: %v\n%s", derr, sb)
	}
	if !withUpper && bytes.Contains(sb, []byte("needs_recovery")) {
		t.Fatalf("sealed image needs journal recovery:\n%s", sb)
	}
}
