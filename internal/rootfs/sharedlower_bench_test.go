package rootfs

import (
	"crypto/rand"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/aenv-dev/aenv/internal/storage/stack"
	"golang.org/x/sys/unix"
)

// systemBusy is the CPU time all CPUs spent outside idle and iowait so far (/proc/stat).
func systemBusy(b *testing.B) time.Duration {
	b.Helper()
	raw, err := os.ReadFile("/proc/stat")
	if err != nil {
		b.Fatal(err)
	}
	line, _, _ := strings.Cut(string(raw), "\n")
	f := strings.Fields(line)
	var busy int64
	for i, v := range f[1:] {
		if i == 3 || i == 4 { // idle, iowait
			continue
		}
		n, _ := strconv.ParseInt(v, 10, 64)
		busy += n
	}
	return time.Duration(busy) * 10 * time.Millisecond
}

func cachedBytes(b *testing.B) int64 {
	b.Helper()
	raw, err := os.ReadFile("/proc/meminfo")
	if err != nil {
		b.Fatal(err)
	}
	for _, line := range strings.Split(string(raw), "\n") {
		if v, ok := strings.CutPrefix(line, "Cached:"); ok {
			n, _ := strconv.ParseInt(strings.TrimSuffix(strings.TrimSpace(v), " kB"), 10, 64)
			return n << 10
		}
	}
	b.Fatal("no Cached in /proc/meminfo")
	return 0
}

// BenchmarkFirstRead measures what a template's files cost a fresh root: each of 32
// roots is opened, then reads the same 6 MiB of files once (a first command's binaries
// and libraries), either as a block root (its own ext4: its own FUSE reads and page
// cache) or as an overlay root over the template's shared lower, read once before by
// another root. It reports the whole machine's CPU time per root for the open and for
// the reads (/proc/stat, so the kernel's loop and FUSE work counts; run it on an idle
// machine) and the page cache the reads added per root.
func BenchmarkFirstRead(b *testing.B) {
	files := map[string]string{}
	for i := range 6 {
		buf := make([]byte, 1<<20)
		rand.Read(buf)
		files[fmt.Sprintf("usr/lib/f%d", i)] = string(buf)
	}
	benchFirstUse(b, func(b *testing.B, dir string) stack.LayerRef { return baseLayer(b, dir, 256, files) },
		func(b *testing.B, root string) { readAll(b, root, files) })
}

// BenchmarkFirstCommand is BenchmarkFirstRead with a real first command, `bash -l -c
// true` chrooted into each root, on a root filesystem tree named by AENV_BENCH_ROOTFS
// (a debootstrap tree, such as the base template's, /var/cache/aenv/base-debian after
// `make base`).
func BenchmarkFirstCommand(b *testing.B) {
	tree := os.Getenv("AENV_BENCH_ROOTFS")
	if tree == "" {
		b.Skip("set AENV_BENCH_ROOTFS to a root filesystem tree with /bin/bash")
	}
	benchFirstUse(b, func(b *testing.B, dir string) stack.LayerRef { return treeLayer(b, dir, "tree", tree, 1024) },
		func(b *testing.B, root string) {
			if out, err := exec.Command("chroot", root, "/bin/bash", "-l", "-c", "true").CombinedOutput(); err != nil {
				b.Fatalf("chroot %s: %v: %s", root, err, out)
			}
		})
}

func benchFirstUse(b *testing.B, layer func(b *testing.B, dir string) stack.LayerRef, use func(b *testing.B, root string)) {
	const roots = 32
	for _, mode := range []string{"block", "overlay"} {
		b.Run("root="+mode, func(b *testing.B) {
			needBlock(b)
			b.StopTimer()
			ctx := b.Context()
			dir := b.TempDir()
			base := layer(b, dir)
			empty, err := EmptyUpper(ctx, dir, 256)
			if err != nil {
				b.Fatal(err)
			}
			lowers := NewLowers(filepath.Join(dir, "lowers"), nil, nil)
			var openCPU, useCPU time.Duration
			var cached int64
			for n := 0; n < b.N; n++ {
				var closers []func() error
				c0 := systemBusy(b)
				var mnts []string
				if mode == "overlay" {
					l, err := lowers.Acquire(ctx, []stack.LayerRef{base})
					if err != nil {
						b.Fatal(err)
					}
					use(b, l.Path()) // an earlier sandbox's first command
					closers = append(closers, func() error { return lowers.Release(l) })
					c0 = systemBusy(b)
					for i := range roots {
						d := filepath.Join(dir, fmt.Sprintf("r%d-%d", n, i))
						o, err := lowers.OpenOverlay(ctx, OverlaySpec{Dir: d, Lower: l, Upper: []stack.LayerRef{empty}, Target: filepath.Join(d, "root"), UserNS: -1})
						if err != nil {
							b.Fatal(err)
						}
						closers = append(closers, o.Close)
						mnts = append(mnts, filepath.Join(d, "root"))
					}
				} else {
					for i := range roots {
						d := filepath.Join(dir, fmt.Sprintf("r%d-%d", n, i))
						blk, err := Open(ctx, Spec{Dir: d, Lowers: []stack.LayerRef{base}, Target: filepath.Join(d, "root"), UserNS: -1})
						if err != nil {
							b.Fatal(err)
						}
						closers = append(closers, blk.Close)
						mnts = append(mnts, filepath.Join(d, "root"))
					}
				}
				openCPU += systemBusy(b) - c0
				unix.Sync()
				c0, m0 := systemBusy(b), cachedBytes(b)
				b.StartTimer()
				for _, m := range mnts {
					use(b, m)
				}
				b.StopTimer()
				useCPU += systemBusy(b) - c0
				cached += cachedBytes(b) - m0
				for i := len(closers) - 1; i >= 0; i-- {
					if err := closers[i](); err != nil {
						b.Fatal(err)
					}
				}
			}
			b.ReportMetric(float64(openCPU.Microseconds())/float64(b.N*roots), "open-cpu-us/root")
			b.ReportMetric(float64(useCPU.Microseconds())/float64(b.N*roots), "use-cpu-us/root")
			b.ReportMetric(float64(cached>>10)/float64(b.N*roots), "cache-KiB/root")
		})
	}
}

func readAll(b *testing.B, root string, files map[string]string) {
	for name, body := range files {
		f, err := os.Open(filepath.Join(root, name))
		if err != nil {
			b.Fatal(err)
		}
		buf := make([]byte, 128<<10)
		total := 0
		for {
			n, err := f.Read(buf)
			total += n
			if err == io.EOF {
				break
			}
			if err != nil {
				b.Fatal(err)
			}
		}
		f.Close()
		if total != len(body) {
			b.Fatalf("%s: read %d bytes, want %d", name, total, len(body))
		}
	}
}
