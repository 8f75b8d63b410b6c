package blockdev

import (
	"context"
	"os"
	"runtime"
	"sync"
	"sync/atomic"
	"testing"
	"time"
	"unsafe"

	"golang.org/x/sys/unix"
)

// gateDev holds every read until open is closed, counting how many it holds at once.
type gateDev struct {
	memDev
	open         chan struct{}
	inside, most atomic.Int32
	// reached is closed once want requests are held at once.
	want    int32
	reached chan struct{}
	once    sync.Once
}

func (d *gateDev) hold() {
	n := d.inside.Add(1)
	for m := d.most.Load(); n > m && !d.most.CompareAndSwap(m, n); m = d.most.Load() {
	}
	if n >= d.want {
		d.once.Do(func() { close(d.reached) })
	}
	<-d.open
	d.inside.Add(-1)
}

func (d *gateDev) ReadAt(p []byte, off int64) (int, error) {
	d.hold()
	return d.memDev.ReadAt(p, off)
}

// TestMountCapsReaders: a mount keeps at most IdleReaders goroutines waiting for requests
// (see IdleReaders for why), however many it had serving a burst, while it serves reads
// (which give their reader's buffer back) however many are queued. GOMAXPROCS is raised
// for the test: go-fuse's own limit on readers follows it.
func TestMountCapsReaders(t *testing.T) {
	requireRoot(t)
	defer runtime.GOMAXPROCS(runtime.GOMAXPROCS(16))
	const queued = 12
	dev := &gateDev{memDev: memDev{b: make([]byte, 4<<20)}, open: make(chan struct{}), want: queued, reached: make(chan struct{})}
	m, err := MountFile(context.Background(), t.TempDir(), dev, MountOptions{})
	if err != nil {
		t.Fatal(err)
	}
	defer m.Close()
	// Raw syscalls: a file of this mount must not reach the netpoller (see pollHack).
	fd, err := unix.Open(m.Path(), unix.O_RDONLY|unix.O_DIRECT|unix.O_CLOEXEC, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer unix.Close(fd)
	var wg sync.WaitGroup
	errs := make(chan error, queued)
	for i := range queued {
		wg.Go(func() {
			raw := make([]byte, 8192)
			p := raw[4096-int(uintptr(unsafe.Pointer(&raw[0]))&4095):][:4096]
			if _, err := unix.Pread(fd, p, int64(i)<<16); err != nil {
				errs <- err
			}
		})
	}
	select {
	case <-dev.reached:
	case <-time.After(10 * time.Second):
		close(dev.open)
		wg.Wait()
		t.Fatalf("at most %d reads reached the device at once with %d queued", dev.most.Load(), queued)
	}
	close(dev.open)
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Error(err)
	}
	// Every goroutine that served a read goes back to reading requests: all but
	// IdleReaders of them must stop.
	var waiting int
	for deadline := time.Now().Add(10 * time.Second); time.Now().Before(deadline); time.Sleep(20 * time.Millisecond) {
		if waiting = threadsIn("fuse_dev_do_read"); waiting >= 1 && waiting <= IdleReaders {
			return
		}
	}
	t.Errorf("%d threads wait for requests of one idle mount, want 1 to %d", waiting, IdleReaders)
}

// threadsIn counts this process's threads sleeping in the kernel function fn.
func threadsIn(fn string) int {
	tasks, _ := os.ReadDir("/proc/self/task")
	n := 0
	for _, task := range tasks {
		if w, err := os.ReadFile("/proc/self/task/" + task.Name() + "/wchan"); err == nil && string(w) == fn {
			n++
		}
	}
	return n
}
