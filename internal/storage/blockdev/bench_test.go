package blockdev

import (
	"context"
	"os"
	"os/exec"
	"path/filepath"
	"testing"

	"github.com/aenv-dev/aenv/internal/storage/stack"
	"golang.org/x/sys/unix"
)

// BenchmarkExt4Sequential measures sequential file I/O on ext4 over a loop
// device over the FUSE-served stack: write (with fsync), then read back
// from the page cache, with the loop device buffered and with direct I/O.
func BenchmarkExt4Sequential(b *testing.B) {
	for _, dio := range []bool{false, true} {
		name := "loop=buffered"
		if dio {
			name = "loop=direct"
		}
		b.Run(name, func(b *testing.B) { benchExt4Sequential(b, dio) })
	}
}

func benchExt4Sequential(b *testing.B, dio bool) {
	if os.Geteuid() != 0 {
		b.Skip("needs root")
	}
	if _, err := exec.LookPath("mkfs.ext4"); err != nil {
		b.Skip("needs mkfs.ext4")
	}
	ctx := context.Background()
	dir := b.TempDir()
	s, err := stack.Open(ctx, &stack.Manifest{Dir: dir, VirtualSize: 1 << 30,
		Upper: &stack.Upper{Data: "u.data", Index: "u.index"}}, stack.Options{})
	if err != nil {
		b.Fatal(err)
	}
	defer s.Close()
	m, err := MountFile(ctx, filepath.Join(dir, "fuse"), s, MountOptions{})
	if err != nil {
		b.Fatal(err)
	}
	defer m.Close()
	l, err := AttachLoopWith(ctx, m.Path(), LoopOptions{DirectIO: dio})
	if err != nil {
		b.Fatal(err)
	}
	defer l.Detach()
	if out, err := exec.Command("mkfs.ext4", "-q", "-E", "nodiscard", l.Path()).CombinedOutput(); err != nil {
		b.Fatalf("mkfs: %v %s", err, out)
	}
	mnt := filepath.Join(dir, "mnt")
	os.MkdirAll(mnt, 0o755)
	if err := unix.Mount(l.Path(), mnt, "ext4", 0, ""); err != nil {
		b.Fatal(err)
	}
	defer unix.Unmount(mnt, 0)
	const size = 256 << 20
	chunk := make([]byte, 1<<20)
	for i := range chunk {
		chunk[i] = byte(i * 7)
	}
	path := filepath.Join(mnt, "f")
	b.Run("write", func(b *testing.B) {
		b.SetBytes(size)
		for i := 0; i < b.N; i++ {
			f, err := os.Create(path)
			if err != nil {
				b.Fatal(err)
			}
			for w := 0; w < size; w += len(chunk) {
				if _, err := f.Write(chunk); err != nil {
					b.Fatal(err)
				}
			}
			if err := f.Sync(); err != nil {
				b.Fatal(err)
			}
			f.Close()
		}
	})
	b.Run("read-cached", func(b *testing.B) {
		b.SetBytes(size)
		for i := 0; i < b.N; i++ {
			f, err := os.Open(path)
			if err != nil {
				b.Fatal(err)
			}
			for {
				n, err := f.Read(chunk)
				if n == 0 || err != nil {
					break
				}
			}
			f.Close()
		}
	})
	b.Run("read-uncached", func(b *testing.B) {
		b.SetBytes(size)
		for i := 0; i < b.N; i++ {
			// Drop ext4's and the loop device's page cache so reads go
			// through the loop device and FUSE to the stack.
			unix.Unmount(mnt, 0)
			if f, err := os.Open(l.Path()); err == nil {
				unix.IoctlSetInt(int(f.Fd()), unix.BLKFLSBUF, 0)
				f.Close()
			}
			os.WriteFile("/proc/sys/vm/drop_caches", []byte("1"), 0o200)
			if err := unix.Mount(l.Path(), mnt, "ext4", 0, ""); err != nil {
				b.Fatal(err)
			}
			f, err := os.Open(path)
			if err != nil {
				b.Fatal(err)
			}
			for {
				n, err := f.Read(chunk)
				if n == 0 || err != nil {
					break
				}
			}
			f.Close()
		}
	})
}
