package rootfs

import (
	"bytes"
	"context"
	"debug/elf"
	"errors"
	"fmt"
	"io"
	"os"
	"path"
	"syscall"

	"golang.org/x/sys/unix"
)

// libDirs are where an ELF's DT_NEEDED libraries are looked for (the usual ld.so
// search path on glibc and musl systems).
var libDirs = []string{"/lib/x86_64-linux-gnu", "/usr/lib/x86_64-linux-gnu", "/lib64", "/usr/lib64",
	"/lib/aarch64-linux-gnu", "/usr/lib/aarch64-linux-gnu", "/lib", "/usr/lib"}

// Prefetch reads the files at paths inside the filesystem mounted at root (each
// path resolved as if root were /, symlinks included), so that their pages are in
// that filesystem's page cache before a sandbox needs them. Every block root has
// its own ext4 and loop device, so nothing another sandbox read is cached for it:
// without this, a sandbox's first command pays a FUSE round trip, a layer lookup
// and a decompression for every readahead window of the shell, its libraries and
// its profile scripts. A directory's regular files are read too (one level), and
// so are an ELF file's interpreter and needed libraries. Missing paths are
// skipped; at most limit bytes are read. It returns the bytes read and the files
// read, in order: PrefetchFiles reads the same files in another root with the same
// contents (a template's next warm container) without resolving them again.
func Prefetch(ctx context.Context, root string, paths []string, limit int64) (int64, []string, error) {
	rfd, err := openRoot(root)
	if err != nil {
		return 0, nil, err
	}
	defer unix.Close(rfd)
	p := prefetcher{rfd: rfd, left: limit, seen: map[string]bool{}, read: map[[2]uint64]bool{}, buf: make([]byte, 256<<10)}
	for _, name := range paths {
		if err := ctx.Err(); err != nil {
			return limit - p.left, p.files, err
		}
		if err := p.path(name, true); err != nil {
			return limit - p.left, p.files, err
		}
	}
	return limit - p.left, p.files, nil
}

// PrefetchFiles puts the regular files at names (as Prefetch returned them) inside the
// filesystem mounted at root into its page cache, at most limit bytes, and returns the
// bytes asked for. It does not wait for the reads (POSIX_FADV_WILLNEED queues them)
// and copies nothing out. Names that are missing or not regular files are skipped.
func PrefetchFiles(ctx context.Context, root string, names []string, limit int64) (int64, error) {
	rfd, err := openRoot(root)
	if err != nil {
		return 0, err
	}
	defer unix.Close(rfd)
	left := limit
	for _, name := range names {
		if left <= 0 {
			break
		}
		if err := ctx.Err(); err != nil {
			return limit - left, err
		}
		// Non-blocking and no controlling tty: opening what is not a regular file
		// (a root unlike the one the names came from) has no effect; it is skipped.
		fd, err := unix.Openat2(rfd, name, &unix.OpenHow{Flags: unix.O_RDONLY | unix.O_NONBLOCK | unix.O_NOCTTY | unix.O_CLOEXEC,
			Resolve: unix.RESOLVE_IN_ROOT | unix.RESOLVE_NO_MAGICLINKS})
		if err != nil {
			continue
		}
		var st unix.Stat_t
		if err := unix.Fstat(fd, &st); err == nil && st.Mode&unix.S_IFMT == unix.S_IFREG {
			n := min(st.Size, left)
			// The kernel reads at most a device's readahead or I/O size (128 KiB and up)
			// per call: one call per such chunk.
			for off := int64(0); off < n; off += willNeedChunk {
				if unix.Fadvise(fd, off, min(willNeedChunk, n-off), unix.FADV_WILLNEED) != nil {
					break
				}
			}
			left -= n
		}
		unix.Close(fd)
	}
	return limit - left, nil
}

// willNeedChunk is what one POSIX_FADV_WILLNEED asks for: the kernel caps each call at
// the device's readahead window or largest I/O, whichever is larger (128 KiB by default).
const willNeedChunk = 128 << 10

func openRoot(root string) (int, error) {
	rfd, err := unix.Open(root, unix.O_PATH|unix.O_DIRECTORY|unix.O_CLOEXEC, 0)
	if err != nil {
		return -1, fmt.Errorf("rootfs: prefetch: open %s: %w", root, err)
	}
	return rfd, nil
}

type prefetcher struct {
	rfd   int
	left  int64
	seen  map[string]bool
	read  map[[2]uint64]bool // files read, by device and inode (names alias through links)
	buf   []byte
	files []string // regular files read, in order
}

// open opens name read-only, or only as a path (O_PATH) when it is not a
// regular file or a directory: opening a device node or a FIFO could block or
// have side effects.
func (p *prefetcher) open(name string) (*os.File, error) {
	how := func(flags uint64) *unix.OpenHow {
		return &unix.OpenHow{Flags: flags | unix.O_CLOEXEC, Resolve: unix.RESOLVE_IN_ROOT | unix.RESOLVE_NO_MAGICLINKS}
	}
	fd, err := unix.Openat2(p.rfd, name, how(unix.O_PATH))
	if err != nil {
		return nil, err
	}
	var st unix.Stat_t
	err = unix.Fstat(fd, &st)
	if err != nil || (st.Mode&unix.S_IFMT != unix.S_IFREG && st.Mode&unix.S_IFMT != unix.S_IFDIR) {
		return os.NewFile(uintptr(fd), name), err
	}
	unix.Close(fd)
	fd, err = unix.Openat2(p.rfd, name, how(unix.O_RDONLY|unix.O_NONBLOCK|unix.O_NOCTTY))
	if err != nil {
		return nil, err
	}
	return os.NewFile(uintptr(fd), name), nil
}

// path reads name; dir says whether a directory's files are read as well.
func (p *prefetcher) path(name string, dir bool) error {
	if p.left <= 0 || p.seen[name] {
		return nil
	}
	p.seen[name] = true
	f, err := p.open(name)
	if errors.Is(err, unix.ENOENT) || errors.Is(err, unix.ENOTDIR) || errors.Is(err, unix.ELOOP) ||
		errors.Is(err, unix.EACCES) || errors.Is(err, unix.EXDEV) {
		return nil
	}
	if err != nil {
		return fmt.Errorf("rootfs: prefetch %s: %w", name, err)
	}
	defer f.Close()
	fi, err := f.Stat()
	if err != nil {
		return fmt.Errorf("rootfs: prefetch %s: %w", name, err)
	}
	switch {
	case fi.IsDir():
		if !dir {
			return nil
		}
		ents, err := f.ReadDir(-1)
		if err != nil {
			return fmt.Errorf("rootfs: prefetch %s: %w", name, err)
		}
		for _, e := range ents {
			if e.Type().IsRegular() {
				if err := p.path(path.Join(name, e.Name()), false); err != nil {
					return err
				}
			}
		}
		return nil
	case !fi.Mode().IsRegular():
		return nil
	}
	if st, ok := fi.Sys().(*syscall.Stat_t); ok {
		id := [2]uint64{st.Dev, st.Ino}
		if p.read[id] {
			return nil
		}
		p.read[id] = true
	}
	p.files = append(p.files, name)
	n, err := io.CopyBuffer(io.Discard, io.LimitReader(onlyReader{f}, p.left), p.buf)
	p.left -= n
	if err != nil {
		return fmt.Errorf("rootfs: prefetch %s: %w", name, err)
	}
	return p.elfDeps(f)
}

// onlyReader hides *os.File's WriterTo, so io.CopyBuffer uses the buffer rather
// than splicing.
type onlyReader struct{ io.Reader }

// elfDeps reads the interpreter and the needed libraries of f if it is a
// dynamically linked ELF file.
func (p *prefetcher) elfDeps(f *os.File) error {
	ef, err := elf.NewFile(f)
	if err != nil {
		return nil // not ELF: nothing more to read
	}
	defer ef.Close()
	for _, pr := range ef.Progs {
		if pr.Type != elf.PT_INTERP {
			continue
		}
		b := make([]byte, min(pr.Filesz, 4096))
		if _, err := pr.ReadAt(b, 0); err == nil {
			if interp, _, _ := bytes.Cut(b, []byte{0}); len(interp) > 0 {
				if err := p.path(string(interp), false); err != nil {
					return err
				}
			}
		}
	}
	libs, err := ef.ImportedLibraries()
	if err != nil {
		return nil // a static binary, or no dynamic section to trust
	}
	for _, lib := range libs {
		for _, d := range libDirs {
			if p.left <= 0 {
				return nil
			}
			cand := path.Join(d, path.Base(lib))
			if fi, err := p.stat(cand); err == nil && fi.Mode().IsRegular() {
				if err := p.path(cand, false); err != nil {
					return err
				}
				break
			}
		}
	}
	return nil
}

func (p *prefetcher) stat(name string) (os.FileInfo, error) {
	f, err := p.open(name)
	if err != nil {
		return nil, err
	}
	defer f.Close()
	return f.Stat()
}
