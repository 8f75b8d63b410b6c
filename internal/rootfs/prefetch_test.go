package rootfs

import (
	"context"
	"debug/elf"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"golang.org/x/sys/unix"
)

func writeSized(t *testing.T, path string, n int) {
	t.Helper()
	if err := os.MkdirAll(filepath.Dir(path), 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(path, []byte(strings.Repeat("x", n)), 0o644); err != nil {
		t.Fatal(err)
	}
}

// TestPrefetch checks what Prefetch reads through the byte count it returns: the
// files are sized so that every combination of them sums differently.
func TestPrefetch(t *testing.T) {
	outside := filepath.Join(t.TempDir(), "secret")
	writeSized(t, outside, 7)
	tests := []struct {
		name  string
		setup func(t *testing.T, root string)
		paths []string
		limit int64
		want  int64
	}{
		{"file", func(t *testing.T, r string) { writeSized(t, r+"/etc/profile", 100) }, []string{"/etc/profile"}, 1 << 20, 100},
		{"missing paths skipped", func(t *testing.T, r string) { writeSized(t, r+"/etc/passwd", 100) },
			[]string{"/etc/profile", "/nodir/x", "/etc/passwd/x", "/etc/passwd"}, 1 << 20, 100},
		{"absolute symlink resolves inside root", func(t *testing.T, r string) {
			writeSized(t, r+"/usr/bin/bash", 1000)
			if err := os.Symlink("/usr/bin", r+"/bin"); err != nil {
				t.Fatal(err)
			}
		}, []string{"/bin/bash"}, 1 << 20, 1000},
		{"symlink cannot escape root", func(t *testing.T, r string) {
			if err := os.MkdirAll(r+"/etc", 0o755); err != nil {
				t.Fatal(err)
			}
			if err := os.Symlink(strings.Repeat("../", 20)+outside[1:], r+"/etc/profile"); err != nil {
				t.Fatal(err)
			}
			if err := os.Symlink(outside, r+"/etc/abs"); err != nil {
				t.Fatal(err)
			}
		}, []string{"/etc/profile", "/etc/abs", "/../../" + outside}, 1 << 20, 0},
		{"directory read one level deep", func(t *testing.T, r string) {
			writeSized(t, r+"/etc/profile.d/a.sh", 100)
			writeSized(t, r+"/etc/profile.d/b.sh", 200)
			writeSized(t, r+"/etc/profile.d/sub/c.sh", 400)
		}, []string{"/etc/profile.d"}, 1 << 20, 300},
		{"each file once", func(t *testing.T, r string) { writeSized(t, r+"/etc/group", 100) },
			[]string{"/etc/group", "/etc/group"}, 1 << 20, 100},
		{"links read once", func(t *testing.T, r string) {
			writeSized(t, r+"/bin/bash", 1000)
			if err := os.Symlink("bash", r+"/bin/sh"); err != nil {
				t.Fatal(err)
			}
			if err := os.Link(r+"/bin/bash", r+"/bin/rbash"); err != nil {
				t.Fatal(err)
			}
		}, []string{"/bin/bash", "/bin/sh", "/bin/rbash"}, 1 << 20, 1000},
		{"limit", func(t *testing.T, r string) {
			writeSized(t, r+"/a", 10000)
			writeSized(t, r+"/b", 10000)
		}, []string{"/a", "/b"}, 12000, 12000},
		{"fifo not opened", func(t *testing.T, r string) {
			if err := unix.Mkfifo(r+"/fifo", 0o644); err != nil {
				t.Fatal(err)
			}
			writeSized(t, r+"/d/f", 100)
			if err := unix.Mkfifo(r+"/d/fifo", 0o644); err != nil {
				t.Fatal(err)
			}
		}, []string{"/fifo", "/d"}, 1 << 20, 100},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			root := t.TempDir()
			tc.setup(t, root)
			got, files, err := Prefetch(context.Background(), root, tc.paths, tc.limit)
			if err != nil {
				t.Fatal(err)
			}
			if got != tc.want {
				t.Fatalf("read %d bytes, want %d", got, tc.want)
			}
			// The same tree elsewhere: the files Prefetch listed come to the same bytes.
			other := t.TempDir()
			tc.setup(t, other)
			if got, err := PrefetchFiles(context.Background(), other, files, tc.limit); err != nil || got != tc.want {
				t.Fatalf("PrefetchFiles of %v: %d bytes (%v), want %d", files, got, err, tc.want)
			}
		})
	}
}

// TestPrefetchFilesSkips: names that are missing, not regular files, or lead out of the
// root in the root PrefetchFiles is given are skipped (a FIFO is not waited on).
func TestPrefetchFilesSkips(t *testing.T) {
	outside := filepath.Join(t.TempDir(), "secret")
	writeSized(t, outside, 7)
	root := t.TempDir()
	writeSized(t, root+"/etc/profile", 100)
	if err := unix.Mkfifo(root+"/fifo", 0o644); err != nil {
		t.Fatal(err)
	}
	if err := os.Symlink(outside, root+"/abs"); err != nil {
		t.Fatal(err)
	}
	got, err := PrefetchFiles(context.Background(), root, []string{"/fifo", "/none", "/abs", "/etc", "/etc/profile"}, 1<<20)
	if err != nil || got != 100 {
		t.Fatalf("PrefetchFiles: %d bytes (%v), want 100", got, err)
	}
}

// TestPrefetchELFDeps reads a dynamically linked executable of the host, and its
// interpreter and libraries as the root (not the host) provides them.
func TestPrefetchELFDeps(t *testing.T) {
	const exe = "/usr/bin/true"
	ef, err := elf.Open(exe)
	if err != nil {
		t.Skipf("no ELF %s on this host: %v", exe, err)
	}
	defer ef.Close()
	var interp string
	for _, p := range ef.Progs {
		if p.Type == elf.PT_INTERP {
			b := make([]byte, p.Filesz)
			if _, err := p.ReadAt(b, 0); err != nil {
				t.Fatal(err)
			}
			interp = strings.TrimRight(string(b), "\x00")
		}
	}
	libs, err := ef.ImportedLibraries()
	if interp == "" || err != nil || len(libs) == 0 {
		t.Skipf("%s is not dynamically linked", exe)
	}
	body, err := os.ReadFile(exe)
	if err != nil {
		t.Fatal(err)
	}
	root := t.TempDir()
	if err := os.MkdirAll(root+"/bin", 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(root+"/bin/prog", body, 0o755); err != nil {
		t.Fatal(err)
	}
	writeSized(t, root+interp, 1000)
	want := int64(len(body)) + 1000
	for i, l := range libs {
		// The first library sits in two search directories: only the first found counts.
		writeSized(t, root+"/lib64/"+filepath.Base(l), 3000+i)
		want += int64(3000 + i)
		if i == 0 {
			writeSized(t, root+"/usr/lib/"+filepath.Base(l), 50)
		}
	}
	got, files, err := Prefetch(context.Background(), root, []string{"/bin/prog"}, 1<<30)
	if err != nil {
		t.Fatal(err)
	}
	if got != want {
		t.Fatalf("read %d bytes, want %d (binary %d, interpreter %s, libraries %v)", got, want, len(body), interp, libs)
	}
	// Listed: the binary, its interpreter, its libraries; read again from the list alone.
	if got, err := PrefetchFiles(context.Background(), root, files, 1<<30); err != nil || got != want {
		t.Fatalf("PrefetchFiles of %v: %d bytes (%v), want %d", files, got, err, want)
	}
}

func TestPrefetchBadRoot(t *testing.T) {
	if _, _, err := Prefetch(context.Background(), filepath.Join(t.TempDir(), "none"), []string{"/a"}, 1<<20); err == nil {
		t.Fatal("no error for a missing root")
	}
}
