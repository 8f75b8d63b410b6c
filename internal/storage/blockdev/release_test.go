package blockdev

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"runtime"
	"testing"
	"time"

	"golang.org/x/sys/unix"
)

// memDev is a Device held entirely in memory, big enough that pinning it shows.
type memDev struct{ b []byte }

func (d *memDev) ReadAt(p []byte, off int64) (int, error)  { return copy(p, d.b[off:]), nil }
func (d *memDev) WriteAt(p []byte, off int64) (int, error) { return copy(d.b[off:], p), nil }
func (d *memDev) Discard(off, n int64) error               { clear(d.b[off : off+n]); return nil }
func (d *memDev) Sync() error                              { return nil }
func (d *memDev) Size() int64                              { return int64(len(d.b)) }

// mountReadClose serves a fresh memDev, reads through the mount so go-fuse fills its
// request pools, closes the mount, and returns a channel closed once the device is
// collected. It is a separate function so no stack slot of the test keeps the device.
func mountReadClose(t *testing.T, dir string) <-chan struct{} {
	t.Helper()
	dev := &memDev{b: make([]byte, 8<<20)}
	gone := make(chan struct{})
	runtime.AddCleanup(dev, func(ch chan struct{}) { close(ch) }, gone)
	m, err := MountFile(context.Background(), dir, dev, MountOptions{})
	if err != nil {
		t.Fatal(err)
	}
	// Raw syscalls: a file of this mount must not reach the netpoller (see pollHack).
	fd, err := unix.Open(m.Path(), unix.O_RDONLY|unix.O_CLOEXEC, 0)
	if err != nil {
		m.Close()
		t.Fatal(err)
	}
	buf := make([]byte, 1<<20)
	for off := int64(0); off < int64(len(dev.b)); off += int64(len(buf)) {
		if _, err := unix.Pread(fd, buf, off); err != nil {
			unix.Close(fd)
			m.Close()
			t.Fatal(err)
		}
	}
	unix.Close(fd)
	if err := m.Close(); err != nil {
		t.Fatal(err)
	}
	return gone
}

// TestCloseReleasesDevice: once Close returns, the mount no longer pins its device. go-fuse's
// per-server sync.Pools keep a stopped server reachable until the second GC after it
// stopped, so without Mount.release the device survives the first GC and a node churning
// sandboxes carries every recently closed root's stack as live heap.
func TestCloseReleasesDevice(t *testing.T) {
	requireRoot(t)
	gone := mountReadClose(t, filepath.Join(t.TempDir(), "fuse"))
	// One GC only: the second would collect the device even through the pools.
	runtime.GC()
	select {
	case <-gone:
	case <-time.After(5 * time.Second): // cleanups run asynchronously after the GC
		t.Fatal("the device is still reachable after Close and a GC")
	}
}

// TestCloseStillInUse: a device file still open when its mount is closed is detached
// (the name is gone at once), Close says ErrStillInUse, and the server keeps serving the
// holder until it lets go; then Done is closed.
func TestCloseStillInUse(t *testing.T) {
	requireRoot(t)
	dir := filepath.Join(t.TempDir(), "fuse")
	dev := &memDev{b: make([]byte, 1<<20)}
	copy(dev.b, "still here")
	m, err := MountFile(context.Background(), dir, dev, MountOptions{})
	if err != nil {
		t.Fatal(err)
	}
	fd, err := unix.Open(m.Path(), unix.O_RDONLY|unix.O_CLOEXEC, 0)
	if err != nil {
		m.Close()
		t.Fatal(err)
	}
	held := true
	defer func() {
		if held {
			unix.Close(fd)
		}
	}()
	if err := m.Close(); !errors.Is(err, ErrStillInUse) {
		t.Fatalf("Close with the file open = %v, want ErrStillInUse", err)
	}
	if _, err := os.Stat(m.Path()); err == nil {
		t.Fatal("the device file is still visible after a lazy detach")
	}
	select {
	case <-m.Done():
		t.Fatal("Done closed while the file is still open")
	default:
	}
	buf := make([]byte, 10)
	if _, err := unix.Pread(fd, buf, 0); err != nil || string(buf) != "still here" {
		t.Fatalf("the holder's read after Close = %q, %v", buf, err)
	}
	unix.Close(fd)
	held = false
	select {
	case <-m.Done():
	case <-time.After(30 * time.Second):
		t.Fatal("the server did not stop after its last user let go")
	}
}

func TestWithoutStillInUse(t *testing.T) {
	other := errors.New("other")
	inUse := fmt.Errorf("disk: %w", ErrStillInUse)
	tests := []struct {
		name string
		in   error
		want error // nil: none left
	}{
		{"nil", nil, nil},
		{"only in use", inUse, nil},
		{"other", other, other},
		{"joined", errors.Join(inUse, other, errors.Join(inUse)), other},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			got := WithoutStillInUse(tt.in)
			if (got == nil) != (tt.want == nil) || (got != nil && (!errors.Is(got, tt.want) || errors.Is(got, ErrStillInUse))) {
				t.Fatalf("WithoutStillInUse(%v) = %v, want %v", tt.in, got, tt.want)
			}
		})
	}
}
