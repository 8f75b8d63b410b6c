package rootfs

import (
	"context"
	"fmt"
	"math/rand/v2"
	"os"
	"os/exec"
	"path/filepath"
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

// startDataPlane runs a data plane in a child process until the benchmark ends.
func startDataPlane(b *testing.B) *dataplane.Client {
	b.Helper()
	dir := b.TempDir()
	cmd := exec.Command(os.Args[0])
	cmd.Env = append(os.Environ(), dataPlaneChildEnv+"="+dir)
	cmd.Stderr = os.Stderr
	if err := cmd.Start(); err != nil {
		b.Fatal(err)
	}
	c := dataplane.NewClient(dataplane.SocketPath(dir))
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
	return c
}

// BenchmarkRootIO measures file I/O in an ext4 root over the layer stack with the stack
// served in this process (how the node served roots before the data plane) and by a data
// plane in another process (how it serves them now): sequential 1 MiB and random 4 KiB
// writes and reads, all O_DIRECT so every one goes through the loop device, FUSE and the
// stack rather than the page cache.
func BenchmarkRootIO(b *testing.B) {
	for _, served := range []string{"inprocess", "dataplane"} {
		b.Run("served="+served, func(b *testing.B) {
			needBlock(b)
			dir := b.TempDir()
			base := baseLayer(b, dir, 512, map[string]string{"f": "x"})
			spec := Spec{Dir: filepath.Join(dir, "s"), Lowers: []stack.LayerRef{base}, Target: filepath.Join(dir, "s", "root")}
			if served == "dataplane" {
				c := startDataPlane(b)
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
					for i := 0; b.Loop(); i++ {
						if _, err := c.op(c.buf, c.off(i)); err != nil {
							b.Fatal(err)
						}
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
