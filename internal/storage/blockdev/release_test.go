package blockdev

import (
	"context"
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
