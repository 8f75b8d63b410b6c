package oci

import (
	"context"
	"os"
	"path/filepath"
	"slices"
	"testing"
	"time"
	"unsafe"

	"github.com/aenv-dev/aenv/internal/rootfs"
	"github.com/aenv-dev/aenv/internal/sandbox"
	"golang.org/x/sys/unix"
)

// residentPages counts the pages of path that are in the page cache, and its pages.
func residentPages(t *testing.T, path string) (resident, pages int) {
	t.Helper()
	f, err := os.Open(path)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	fi, err := f.Stat()
	if err != nil {
		t.Fatal(err)
	}
	if fi.Size() == 0 {
		t.Fatalf("%s is empty", path)
	}
	m, err := unix.Mmap(int(f.Fd()), 0, int(fi.Size()), unix.PROT_READ, unix.MAP_SHARED)
	if err != nil {
		t.Fatal(err)
	}
	defer unix.Munmap(m)
	vec := make([]byte, (len(m)+os.Getpagesize()-1)/os.Getpagesize())
	if _, _, e := unix.Syscall(unix.SYS_MINCORE, uintptr(unsafe.Pointer(&m[0])), uintptr(len(m)),
		uintptr(unsafe.Pointer(&vec[0]))); e != 0 {
		t.Fatal(e)
	}
	for _, v := range vec {
		resident += int(v & 1)
	}
	return resident, len(vec)
}

// TestBlockWarmPrefetched: a warm container's block root (its own ext4, so its own empty
// page cache) has the first command's shell read in before a launch takes it: the first
// one of the template by resolving the files, the next ones from the list that made.
func TestBlockWarmPrefetched(t *testing.T) {
	e := newTestBackend(t, func(c *Config) { c.WarmContainers = 2 })
	fs := testLayered(t)
	e.launchBlock(t, "bp0", fs, sandbox.Resources{})
	key := blockKey(layerRefs(fs.Layers), nil, fs.VirtualSize)
	waitWarm(t, e.b, key, 2)
	e.b.warm.mu.Lock()
	ws := slices.Clone(e.b.warm.ready[key])
	listed := e.b.warm.prefetch[key]
	e.b.warm.mu.Unlock()
	if !slices.Contains(listed, "/bin/bash") {
		t.Fatalf("the template's prefetch list %v lacks /bin/bash", listed)
	}
	for _, w := range ws {
		bash := filepath.Join(w.l.rootfs(), "bin", "bash")
		// The list's reads are queued, not waited for, and readahead is best effort: on a
		// host short of memory (a CI run's microVM tests beside this one) the kernel may
		// skip a few pages of it (558 of 572 seen). Unprefetched, a fresh root has none.
		res, n := residentPages(t, bash)
		for deadline := time.Now().Add(5 * time.Second); res != n && time.Now().Before(deadline); time.Sleep(20 * time.Millisecond) {
			res, n = residentPages(t, bash)
		}
		if res*10 < n*9 {
			t.Fatalf("warm container %s's /bin/bash: %d of %d pages in the page cache", w.cid, res, n)
		}
	}
	// The check above can tell: the pages of a file dropped from the page cache are out.
	// (A file of the root nobody read would do too, but the warm container's init, started
	// with the pool, has read the test template's only other big file, busybox.)
	probe := filepath.Join(t.TempDir(), "probe")
	if err := os.WriteFile(probe, make([]byte, 64<<10), 0o644); err != nil {
		t.Fatal(err)
	}
	f, err := os.Open(probe)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	if err := f.Sync(); err != nil {
		t.Fatal(err)
	}
	if err := unix.Fadvise(int(f.Fd()), 0, 0, unix.FADV_DONTNEED); err != nil {
		t.Fatal(err)
	}
	if res, n := residentPages(t, probe); res == n {
		t.Fatalf("%s: all %d pages cached after they were dropped", probe, n)
	}
}

// TestFirstCommandFilesDebian: on a Debian-style root, the warm pool's prefetch list takes
// in what a login shell's first command reads besides the shell: `id` (Debian's
// /etc/profile runs `id -u`) and, for a UTF-8 LANG, the locale's files and the gconv
// cache. Each was a page fault through FUSE in a sandbox's first command.
func TestFirstCommandFilesDebian(t *testing.T) {
	root := t.TempDir()
	files := map[string]int{
		"usr/bin/id":                                         3000,
		"usr/lib/locale/C.utf8/LC_CTYPE":                     5000,
		"usr/lib/locale/C.utf8/LC_NUMERIC":                   50,
		"usr/lib/locale/C.utf8/LC_MESSAGES/SYS_LC_MESSAGES":  48,
		"usr/lib/x86_64-linux-gnu/gconv/gconv-modules.cache": 700,
		"etc/profile":                                        600,
	}
	want := int64(0)
	for name, size := range files {
		p := filepath.Join(root, name)
		if err := os.MkdirAll(filepath.Dir(p), 0o755); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(p, make([]byte, size), 0o644); err != nil {
			t.Fatal(err)
		}
		want += int64(size)
	}
	got, _, err := rootfs.Prefetch(context.Background(), root, firstCommandFiles, prefetchLimit)
	if err != nil {
		t.Fatal(err)
	}
	if got != want {
		t.Fatalf("prefetched %d bytes of the first command's files, want all %d", got, want)
	}
}
