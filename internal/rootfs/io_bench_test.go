package rootfs

import (
	"context"
	"fmt"
	"math/rand/v2"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"
	"unsafe"

	"github.com/aenv-dev/aenv/internal/dataplane"
	"github.com/aenv-dev/aenv/internal/storage/stack"
	"golang.org/x/sys/unix"
)

// dataPlaneChildEnv makes the test binary run a data plane in the directory it names
// (TestMain), so the benchmarks can serve a root from another process as the node does.
const dataPlaneChildEnv = "AENV_ROOTFS_TEST_DATAPLANE"

func TestMain(m *testing.M) {
	if dir := os.Getenv(dataPlaneChildEnv); dir != "" {
		if err := dataplane.Run(context.Background(), dir, "test", nil); err != nil {
			fmt.Fprintln(os.Stderr, err)
			os.Exit(1)
		}
		os.Exit(0)
	}
	os.Exit(m.Run())
}

// startDataPlane runs a data plane in a child process until the benchmark ends; pid is
// the child's.
func startDataPlane(b testing.TB) (c *dataplane.Client, pid int) {
	b.Helper()
	dir := b.TempDir()
	cmd := exec.Command(os.Args[0])
	cmd.Env = append(os.Environ(), dataPlaneChildEnv+"="+dir)
	cmd.Stderr = os.Stderr
	if err := cmd.Start(); err != nil {
		b.Fatal(err)
	}
	c = dataplane.NewClient(dataplane.SocketPath(dir))
	for deadline := time.Now().Add(10 * time.Second); c.Ping(context.Background()) != nil; time.Sleep(10 * time.Millisecond) {
		if time.Now().After(deadline) {
			cmd.Process.Kill()
			b.Fatal("the data plane does not answer")
		}
	}
	b.Cleanup(func() {
		_ = c.Shutdown(context.Background())
		done := make(chan struct{})
		go func() { cmd.Wait(); close(done) }()
		select {
		case <-done:
		case <-time.After(5 * time.Second):
			cmd.Process.Kill()
			<-done
		}
	})
	return c, cmd.Process.Pid
}

// usage is what the threads of some processes have used so far: CPU time (the sum of
// their schedstat run times, in nanoseconds unlike /proc/PID/stat's clock ticks) and
// voluntary context switches (each a sleep and a wake-up).
type usage struct {
	cpu      time.Duration
	switches int64
}

func usageOf(b *testing.B, pids []int) usage {
	b.Helper()
	var u usage
	for _, pid := range pids {
		tasks, err := os.ReadDir(fmt.Sprintf("/proc/%d/task", pid))
		if err != nil {
			b.Fatal(err)
		}
		for _, t := range tasks {
			dir := fmt.Sprintf("/proc/%d/task/%s/", pid, t.Name())
			raw, err := os.ReadFile(dir + "schedstat")
			if err != nil {
				continue // the thread exited meanwhile
			}
			var ns int64
			if _, err := fmt.Sscan(string(raw), &ns); err != nil {
				b.Fatalf("%sschedstat: %v", dir, err)
			}
			u.cpu += time.Duration(ns)
			raw, err = os.ReadFile(dir + "status")
			if err != nil {
				continue
			}
			for _, line := range strings.Split(string(raw), "\n") {
				if v, ok := strings.CutPrefix(line, "voluntary_ctxt_switches:"); ok {
					n, _ := strconv.ParseInt(strings.TrimSpace(v), 10, 64)
					u.switches += n
				}
			}
		}
	}
	return u
}

// BenchmarkRootIO measures file I/O in an ext4 root over the layer stack with the stack
// served in this process (how the node served roots before the data plane) and by a data
// plane in another process (how it serves them now): sequential 1 MiB and random 4 KiB
// writes and reads, all O_DIRECT so every one goes through the loop device, FUSE and the
// stack rather than the page cache. Besides wall time it reports cpu-us/op, the CPU time
// this process and the data plane (when there is one) used per operation, which a busy
// shared host perturbs less than wall time, and sleeps/op: how many times their threads
// went to sleep (voluntary context switches) per operation, which load hardly changes
// (the kernel's loop worker threads are in neither, and are the same for both); with a
// data plane, dp-cpu-us/op and dp-sleeps/op are its share. Serving a request ideally
// costs the server one sleep (waiting for the next request).
func BenchmarkRootIO(b *testing.B) {
	for _, served := range []string{"inprocess", "dataplane"} {
		b.Run("served="+served, func(b *testing.B) {
			needBlock(b)
			dir := b.TempDir()
			base := baseLayer(b, dir, 512, map[string]string{"f": "x"})
			spec := Spec{Dir: filepath.Join(dir, "s"), Lowers: []stack.LayerRef{base}, Target: filepath.Join(dir, "s", "root")}
			servers := []int{os.Getpid()}
			if served == "dataplane" {
				c, pid := startDataPlane(b)
				servers = append(servers, pid)
				spec.Open = func(ctx context.Context, s dataplane.Spec) (ServedDisk, error) { return c.Open(ctx, s) }
			}
			blk := open(b, spec)
			if blk.OutOfProcess() != (served == "dataplane") {
				b.Fatalf("served out of process: %v", blk.OutOfProcess())
			}
			const fileSize = 128 << 20
			path := filepath.Join(spec.Target, "data")
			fd, err := unix.Open(path, unix.O_RDWR|unix.O_CREAT|unix.O_DIRECT, 0o644)
			if err != nil {
				b.Fatal(err)
			}
			defer unix.Close(fd)
			big := alignedBuf(1 << 20)
			small := alignedBuf(4096)
			for off := int64(0); off < fileSize; off += int64(len(big)) {
				if _, err := unix.Pwrite(fd, big, off); err != nil {
					b.Fatal(err)
				}
			}
			_ = unix.Fsync(fd)
			rnd := rand.New(rand.NewPCG(1, 2))
			randOff := func() int64 { return rnd.Int64N(fileSize/4096) * 4096 }
			for _, c := range []struct {
				name string
				buf  []byte
				op   func(p []byte, off int64) (int, error)
				off  func(i int) int64
			}{
				{"seq-write-1M", big, func(p []byte, off int64) (int, error) { return unix.Pwrite(fd, p, off) }, func(i int) int64 { return int64(i%(fileSize>>20)) << 20 }},
				{"seq-read-1M", big, func(p []byte, off int64) (int, error) { return unix.Pread(fd, p, off) }, func(i int) int64 { return int64(i%(fileSize>>20)) << 20 }},
				{"rand-write-4K", small, func(p []byte, off int64) (int, error) { return unix.Pwrite(fd, p, off) }, func(int) int64 { return randOff() }},
				{"rand-read-4K", small, func(p []byte, off int64) (int, error) { return unix.Pread(fd, p, off) }, func(int) int64 { return randOff() }},
			} {
				b.Run(c.name, func(b *testing.B) {
					b.SetBytes(int64(len(c.buf)))
					u0 := usageOf(b, servers)
					d0 := usageOf(b, servers[1:])
					n := 0
					for ; b.Loop(); n++ {
						if _, err := c.op(c.buf, c.off(n)); err != nil {
							b.Fatal(err)
						}
					}
					u := usageOf(b, servers)
					b.ReportMetric(float64((u.cpu-u0.cpu).Microseconds())/float64(n), "cpu-us/op")
					b.ReportMetric(float64(u.switches-u0.switches)/float64(n), "sleeps/op")
					if len(servers) > 1 {
						d := usageOf(b, servers[1:])
						b.ReportMetric(float64((d.cpu-d0.cpu).Microseconds())/float64(n), "dp-cpu-us/op")
						b.ReportMetric(float64(d.switches-d0.switches)/float64(n), "dp-sleeps/op")
					}
				})
			}
		})
	}
}

// alignedBuf is an n-byte buffer aligned for O_DIRECT, filled with random bytes.
func alignedBuf(n int) []byte {
	raw := make([]byte, n+4096)
	off := 0
	for (uintptrOf(raw[off:]) & 4095) != 0 {
		off++
	}
	buf := raw[off : off+n]
	for i := range buf {
		buf[i] = byte(rand.IntN(256))
	}
	return buf
}

func uintptrOf(p []byte) uintptr { return uintptr(unsafe.Pointer(&p[0])) }

// BenchmarkDataPlaneIdle measures what a data plane serving 20 mounted roots costs while
// nothing uses them: each op is a second of idleness, and it reports the data plane's
// CPU time and sleeps (thread wake-ups) per second. Serving must not poll: an idle
// disk costs nothing.
func BenchmarkDataPlaneIdle(b *testing.B) {
	needBlock(b)
	dir := b.TempDir()
	base := baseLayer(b, dir, 64, map[string]string{"f": "x"})
	c, pid := startDataPlane(b)
	for i := range 20 {
		d := filepath.Join(dir, fmt.Sprint("s", i))
		open(b, Spec{Dir: d, Lowers: []stack.LayerRef{base}, Target: filepath.Join(d, "root"),
			Open: func(ctx context.Context, s dataplane.Spec) (ServedDisk, error) { return c.Open(ctx, s) }})
		if err := os.WriteFile(filepath.Join(d, "root", "written"), []byte("x"), 0o644); err != nil {
			b.Fatal(err)
		}
	}
	unix.Sync()
	time.Sleep(time.Second) // let the flushers and writeback settle
	u0 := usageOf(b, []int{pid})
	n := 0
	for ; b.Loop(); n++ {
		time.Sleep(time.Second)
	}
	u := usageOf(b, []int{pid})
	b.ReportMetric(float64((u.cpu-u0.cpu).Microseconds())/float64(n), "cpu-us/s")
	b.ReportMetric(float64(u.switches-u0.switches)/float64(n), "sleeps/s")
}
