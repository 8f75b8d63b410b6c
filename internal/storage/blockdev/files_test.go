package blockdev

import (
	"bytes"
	"context"
	"errors"
	"os"
	"path/filepath"
	"testing"
	"time"

	"golang.org/x/sys/unix"
)

// TestFilesServeEach: a shared mount serves each device as its own file, all through one
// mount, and a removed file's name does not open any more.
func TestFilesServeEach(t *testing.T) {
	requireRoot(t)
	ctx := context.Background()
	dir := filepath.Join(t.TempDir(), "fuse")
	fs, err := ServeFiles(ctx, dir)
	if err != nil {
		t.Fatal(err)
	}
	defer func() {
		if err := fs.Close(); err != nil {
			t.Error(err)
		}
	}()
	var files []*File
	for i := range 3 {
		dev := &memDev{b: bytes.Repeat([]byte{byte('a' + i)}, 1<<20)}
		f, err := fs.Add(ctx, dev)
		if err != nil {
			t.Fatal(err)
		}
		files = append(files, f)
	}
	for i, f := range files {
		got := preadFile(t, f.Path(), 4096, 1<<19)
		if want := bytes.Repeat([]byte{byte('a' + i)}, 4096); !bytes.Equal(got, want) {
			t.Fatalf("%s reads %q…, want %q…", f.Path(), got[:4], want[:4])
		}
		if fi, err := os.Stat(f.Path()); err != nil || fi.Size() != 1<<20 {
			t.Fatalf("stat %s: %v, %v", f.Path(), fi, err)
		}
	}
	if n := len(mountsAt(t, dir)); n != 1 {
		t.Fatalf("%d mounts at %s, want 1", n, dir)
	}
	if err := files[1].Close(); err != nil {
		t.Fatal(err)
	}
	if _, err := unix.Open(files[1].Path(), unix.O_RDONLY|unix.O_CLOEXEC, 0); !errors.Is(err, unix.ENOENT) {
		t.Fatalf("open of a closed file: %v, want ENOENT", err)
	}
	if got := preadFile(t, files[2].Path(), 1, 0); got[0] != 'c' {
		t.Fatalf("the other files stop serving after one closed: %q", got)
	}
	for _, f := range []*File{files[0], files[2]} {
		if err := f.Close(); err != nil {
			t.Fatal(err)
		}
	}
}

// TestFilesCloseWaitsForRelease: Close returns only once whatever had the file open (a
// loop device, a VMM) let go, so the device is not closed under it.
func TestFilesCloseWaitsForRelease(t *testing.T) {
	requireRoot(t)
	ctx := context.Background()
	fs, err := ServeFiles(ctx, filepath.Join(t.TempDir(), "fuse"))
	if err != nil {
		t.Fatal(err)
	}
	defer fs.Close()
	f, err := fs.Add(ctx, &memDev{b: make([]byte, 1<<20)})
	if err != nil {
		t.Fatal(err)
	}
	fd, err := unix.Open(f.Path(), unix.O_RDWR|unix.O_CLOEXEC, 0)
	if err != nil {
		t.Fatal(err)
	}
	closed := make(chan error, 1)
	go func() { closed <- f.Close() }()
	select {
	case err := <-closed:
		unix.Close(fd)
		t.Fatalf("Close returned (%v) while the file was open", err)
	case <-time.After(200 * time.Millisecond):
	}
	// Still served to its holder meanwhile.
	if _, err := unix.Pwrite(fd, []byte("x"), 0); err != nil {
		t.Fatalf("write while closing: %v", err)
	}
	unix.Close(fd)
	select {
	case err := <-closed:
		if err != nil {
			t.Fatal(err)
		}
	case <-time.After(4 * time.Second):
		t.Fatal("Close did not return after the last holder let go")
	}
	select {
	case <-f.Done():
	default:
		t.Fatal("Done is not closed after Close returned")
	}
}

// TestServeFilesReplacesDeadMount: a shared mount left by a server that died is aborted
// and detached, not mounted over.
func TestServeFilesReplacesDeadMount(t *testing.T) {
	requireRoot(t)
	ctx := context.Background()
	dir := filepath.Join(t.TempDir(), "fuse")
	dead, err := ServeFiles(ctx, dir)
	if err != nil {
		t.Fatal(err)
	}
	defer dead.Close()
	fs, err := ServeFiles(ctx, dir)
	if err != nil {
		t.Fatal(err)
	}
	defer fs.Close()
	if n := len(mountsAt(t, dir)); n != 1 {
		t.Fatalf("%d mounts at %s, want 1", n, dir)
	}
	f, err := fs.Add(ctx, &memDev{b: []byte("served by the new one")})
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	if got := preadFile(t, f.Path(), 6, 0); string(got) != "served" {
		t.Fatalf("read %q", got)
	}
}

func preadFile(t *testing.T, path string, n int, off int64) []byte {
	t.Helper()
	// Raw syscalls: a file of this mount must not reach the netpoller (see pollHack).
	fd, err := unix.Open(path, unix.O_RDONLY|unix.O_CLOEXEC, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer unix.Close(fd)
	b := make([]byte, n)
	if _, err := unix.Pread(fd, b, off); err != nil {
		t.Fatal(err)
	}
	return b
}

// TestSweepSharedFiles: a sweep of a root finds the loop devices of its directories whose
// files a shared mount outside it serves (by the name each records), detaches those not
// kept, and leaves the shared connection alone: it serves the kept ones, which keep
// working.
func TestSweepSharedFiles(t *testing.T) {
	requireRoot(t)
	ctx := context.Background()
	base := t.TempDir()
	root := filepath.Join(base, "sandboxes")
	fs, err := ServeFiles(ctx, filepath.Join(base, "dataplane", "fuse"))
	if err != nil {
		t.Fatal(err)
	}
	defer fs.Close()
	loops := map[string]*Loop{}
	for _, id := range []string{"kept", "gone"} {
		f, err := fs.Add(ctx, &memDev{b: bytes.Repeat([]byte(id[:1]), 1<<20)})
		if err != nil {
			t.Fatal(err)
		}
		defer f.Close()
		l, err := AttachLoopWith(ctx, f.Path(), LoopOptions{Name: filepath.Join(root, id, "disk")})
		if err != nil {
			t.Fatal(err)
		}
		defer l.Detach()
		loops[id] = l
	}
	swept, err := SweepLoops(ctx, root, filepath.Join(root, "kept"))
	if err != nil {
		t.Fatal(err)
	}
	if len(swept) != 1 || swept[0] != loops["gone"].Path() {
		t.Fatalf("swept %v, want only %s", swept, loops["gone"].Path())
	}
	// Still open here (as a mount holds it in a node): the sweep marked it to detach on
	// its last close.
	loops["gone"].Release()
	if !waitFor(5*time.Second, func() bool { return !loopAttached(loops["gone"].Path()) }) {
		t.Fatalf("%s is still attached after the sweep", loops["gone"].Path())
	}
	if !loopAttached(loops["kept"].Path()) {
		t.Fatal("the kept device was detached")
	}
	if got := preadFile(t, loops["kept"].Path(), 1, 0); got[0] != 'k' {
		t.Fatalf("the kept device reads %q after the sweep", got)
	}
}

func loopAttached(dev string) bool {
	_, err := LoopBacking(dev)
	return err == nil
}

// mountsAt lists this package's FUSE mounts at dir (and below it: none in these tests).
func mountsAt(t *testing.T, dir string) []string {
	t.Helper()
	ms, err := fuseMounts(dir)
	if err != nil {
		t.Fatal(err)
	}
	return ms
}

func waitFor(d time.Duration, cond func() bool) bool {
	deadline := time.Now().Add(d)
	for !cond() {
		if time.Now().After(deadline) {
			return false
		}
		time.Sleep(10 * time.Millisecond)
	}
	return true
}
