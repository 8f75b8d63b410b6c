// Package unpack applies OCI/Docker image layer tars onto a directory tree:
// whiteouts and opaque directories, hard and symbolic links, device nodes,
// ownership, modes, extended attributes and times. Every path is resolved
// inside the root with chroot semantics, so no entry (absolute or ".." names,
// symlinks pointing out, a symlink followed by a write through it) can touch
// anything outside it.
//
// A failed Apply leaves the tree partly changed; callers unpack into a
// directory they discard on error (a temporary rootfs, a throwaway upper).
package unpack

import (
	"archive/tar"
	"context"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"log/slog"
	"os"
	"path"
	"strings"
	"time"

	"golang.org/x/sys/unix"
)

// Whiteout markers (OCI image spec, "Representing Changes").
const (
	whiteoutPrefix = ".wh."
	whiteoutMeta   = ".wh..wh."
	opaqueMarker   = ".wh..wh..opq"
)

// ErrUnsupported marks an entry type the applier refuses.
var ErrUnsupported = errors.New("unsupported layer entry")

// Options tune Apply.
type Options struct {
	// NoChown keeps the applying user's ownership instead of the tar's uid/gid.
	// Ownership is only applied when running as root anyway.
	NoChown bool
	// Log receives debug lines about skipped attributes; nil means slog.Default.
	Log *slog.Logger
	// MinFree keeps this many bytes free on root's filesystem: Apply fails with
	// ErrNoSpace rather than fill a disk the node itself needs (its catalog, other
	// sandboxes). 0: no check.
	MinFree int64
}

// Stats counts what Apply did.
type Stats struct {
	Entries   int
	Files     int
	Dirs      int
	Symlinks  int
	Hardlinks int
	Devices   int // character, block and FIFO nodes created
	Whiteouts int // .wh. entries and opaque markers honoured
	Bytes     int64
	// Skipped counts attributes or nodes that could not be applied here
	// (device nodes without root, xattrs the filesystem refuses).
	Skipped int
}

type dirTime struct {
	rel   string
	atime time.Time
	mtime time.Time
}

type applier struct {
	root     *os.Root
	log      *slog.Logger
	chown    bool
	devices  bool
	seen     map[string]bool // paths written by this layer
	ancestor map[string]bool // proper ancestors of seen paths
	dirTimes []dirTime
	st       Stats
	// dirs caches open parent directories by the entry's unresolved
	// directory name: most entries land next to the previous one. Any change
	// that could alter how a name resolves (a removed directory or symlink,
	// a whiteout) drops the whole cache.
	dirs map[string]openDir
	buf  []byte // copySparse's scratch space
	free freeSpace
}

type openDir struct {
	rel string // resolved, symlink-free
	f   *os.File
}

// maxOpenDirs bounds the parent directory cache (file descriptors).
const maxOpenDirs = 256

func (a *applier) dropDirs() { a.dropDirsExcept("\x00") }

// dropDirsExcept empties the cache but for the entry keep (an open parent
// in use, whose own resolution is unaffected by changes to its children).
func (a *applier) dropDirsExcept(keep string) {
	for k, d := range a.dirs {
		if k != keep {
			d.f.Close()
			delete(a.dirs, k)
		}
	}
}

// parentDir resolves, creates when missing, and opens the directory dir.
func (a *applier) parentDir(dir string) (openDir, error) {
	if d, ok := a.dirs[dir]; ok {
		return d, nil
	}
	parent, err := resolveDir(a.root, dir)
	if err != nil {
		return openDir{}, err
	}
	if parent == "" {
		parent = "."
	}
	if err := a.root.MkdirAll(parent, 0o755); err != nil {
		return openDir{}, fmt.Errorf("create parent: %w", err)
	}
	f, err := a.root.Open(parent)
	if err != nil {
		return openDir{}, err
	}
	if len(a.dirs) >= maxOpenDirs {
		a.dropDirs()
	}
	d := openDir{rel: parent, f: f}
	a.dirs[dir] = d
	return d, nil
}

// Apply reads the uncompressed layer tar r and applies it onto the directory
// root.
func Apply(ctx context.Context, root string, r io.Reader, o Options) (Stats, error) {
	rt, err := os.OpenRoot(root)
	if err != nil {
		return Stats{}, fmt.Errorf("unpack: %w", err)
	}
	defer rt.Close()
	a := &applier{
		root: rt, log: o.Log,
		free:     freeSpace{path: root, min: o.MinFree},
		chown:    !o.NoChown && os.Geteuid() == 0,
		devices:  os.Geteuid() == 0,
		seen:     map[string]bool{},
		ancestor: map[string]bool{},
		dirs:     map[string]openDir{},
	}
	defer a.dropDirs()
	if a.log == nil {
		a.log = slog.Default()
	}
	tr := tar.NewReader(r)
	for {
		if err := ctx.Err(); err != nil {
			return a.st, err
		}
		h, err := tr.Next()
		if errors.Is(err, io.EOF) {
			break
		}
		if err != nil {
			return a.st, fmt.Errorf("unpack: read tar: %w", err)
		}
		if err := a.entry(h, tr); err != nil {
			return a.st, fmt.Errorf("unpack: %q: %w", h.Name, err)
		}
		a.st.Entries++
	}
	// Directory times last: creating entries inside a directory bumps its mtime.
	for i := len(a.dirTimes) - 1; i >= 0; i-- {
		d := a.dirTimes[i]
		if err := a.setTimes(d.rel, d.atime, d.mtime); err != nil && !errors.Is(err, fs.ErrNotExist) {
			return a.st, fmt.Errorf("unpack: times of %q: %w", d.rel, err)
		}
	}
	return a.st, nil
}

func (a *applier) markSeen(rel string) {
	a.seen[rel] = true
	for p := path.Dir(rel); p != "." && p != "/" && !a.ancestor[p]; p = path.Dir(p) {
		a.ancestor[p] = true
	}
}

func (a *applier) entry(h *tar.Header, r io.Reader) error {
	switch h.Typeflag {
	case tar.TypeXGlobalHeader:
		return nil
	}
	rel, err := cleanName(h.Name)
	if err != nil {
		return err
	}
	if rel == "" {
		if h.Typeflag != tar.TypeDir {
			return fmt.Errorf("%w: the root can only be a directory", ErrUnsupported)
		}
		return a.meta(".", h, true)
	}
	dir, base := path.Split(rel)
	if strings.HasPrefix(base, whiteoutPrefix) {
		return a.whiteout(dir, base)
	}
	pd, err := a.parentDir(dir)
	if err != nil {
		return err
	}
	target := path.Join(pd.rel, base)
	dfd := int(pd.f.Fd())
	isDir := h.Typeflag == tar.TypeDir
	if err := a.clear(dfd, dir, target, base, isDir); err != nil {
		return err
	}
	mode := uint32(h.Mode) & 0o7777
	switch h.Typeflag {
	case tar.TypeReg, tar.TypeGNUSparse, tar.TypeCont:
		fd, err := unix.Openat(dfd, base, unix.O_WRONLY|unix.O_CREAT|unix.O_EXCL|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0o600)
		if err != nil {
			return fmt.Errorf("create file: %w", err)
		}
		f := os.NewFile(uintptr(fd), target)
		if a.buf == nil {
			a.buf = make([]byte, sparseChunk)
		}
		n, err := copySparse(f, r, a.buf, a.free.reserve)
		if cerr := f.Close(); err == nil {
			err = cerr
		}
		if err != nil {
			return fmt.Errorf("write file: %w", err)
		}
		a.st.Files++
		a.st.Bytes += n
	case tar.TypeDir:
		if err := unix.Mkdirat(dfd, base, 0o700); err != nil && !errors.Is(err, unix.EEXIST) {
			return fmt.Errorf("mkdir: %w", err)
		}
		a.st.Dirs++
	case tar.TypeSymlink:
		if h.Linkname == "" || strings.IndexByte(h.Linkname, 0) >= 0 {
			return fmt.Errorf("%w: bad symlink target %q", ErrUnsafePath, h.Linkname)
		}
		// The target is stored verbatim: it is only ever followed with
		// chroot semantics (resolveDir) or inside the sandbox's own root.
		if err := unix.Symlinkat(h.Linkname, dfd, base); err != nil {
			return fmt.Errorf("symlink: %w", err)
		}
		a.st.Symlinks++
	case tar.TypeLink:
		if err := a.hardlink(dfd, target, base, h.Linkname); err != nil {
			return err
		}
		a.st.Hardlinks++
		a.markSeen(target)
		// A hard link shares the source's inode and metadata.
		return nil
	case tar.TypeChar, tar.TypeBlock, tar.TypeFifo:
		kind := map[byte]uint32{tar.TypeChar: unix.S_IFCHR, tar.TypeBlock: unix.S_IFBLK, tar.TypeFifo: unix.S_IFIFO}[h.Typeflag]
		if kind != unix.S_IFIFO && !a.devices {
			a.st.Skipped++
			a.log.Debug("unpack: device node skipped (not root)", "path", target)
			return nil
		}
		dev := unix.Mkdev(uint32(h.Devmajor), uint32(h.Devminor))
		if err := unix.Mknodat(dfd, base, kind|mode, int(dev)); err != nil {
			return fmt.Errorf("mknod: %w", err)
		}
		a.st.Devices++
	default:
		return fmt.Errorf("%w: type %q", ErrUnsupported, h.Typeflag)
	}
	a.markSeen(target)
	return a.metaAt(dfd, target, base, h)
}

// whiteout handles .wh. entries and opaque markers.
func (a *applier) whiteout(dir, base string) error {
	a.dropDirs()
	parent, err := resolveDir(a.root, dir)
	if err != nil {
		return err
	}
	if parent == "" {
		parent = "."
	}
	switch {
	case base == opaqueMarker:
		a.st.Whiteouts++
		return a.opaque(parent)
	case strings.HasPrefix(base, whiteoutMeta):
		// Other AUFS metadata (.wh..wh.plnk, .wh..wh.aufs): not content.
		return nil
	}
	a.st.Whiteouts++
	name := strings.TrimPrefix(base, whiteoutPrefix)
	if name == "" || name == "." || name == ".." {
		return fmt.Errorf("%w: whiteout of %q", ErrUnsafePath, name)
	}
	err = a.root.RemoveAll(path.Join(parent, name))
	if err != nil && !errors.Is(err, fs.ErrNotExist) && !errors.Is(err, unix.ENOTDIR) {
		return fmt.Errorf("whiteout: %w", err)
	}
	return nil
}

// clear makes room for a new entry at target: an existing directory stays
// when the entry is a directory too (tar semantics: update its metadata);
// anything else already there is removed, never followed.
func (a *applier) clear(dfd int, dir, target, base string, isDir bool) error {
	var st unix.Stat_t
	err := unix.Fstatat(dfd, base, &st, unix.AT_SYMLINK_NOFOLLOW)
	if errors.Is(err, unix.ENOENT) {
		return nil
	}
	if err != nil {
		return fmt.Errorf("stat existing: %w", err)
	}
	existingDir := st.Mode&unix.S_IFMT == unix.S_IFDIR
	if existingDir && isDir {
		return nil
	}
	if existingDir || st.Mode&unix.S_IFMT == unix.S_IFLNK {
		// Cached parents may resolve through what is removed here.
		a.dropDirsExcept(dir)
	}
	if existingDir {
		return a.root.RemoveAll(target)
	}
	if err := unix.Unlinkat(dfd, base, 0); err != nil {
		return fmt.Errorf("replace existing: %w", err)
	}
	return nil
}

func (a *applier) hardlink(dfd int, target, base, linkname string) error {
	src, err := cleanName(linkname)
	if err != nil || src == "" {
		return fmt.Errorf("%w: hard link to %q", ErrUnsafePath, linkname)
	}
	sdir, sbase := path.Split(src)
	sparent, err := resolveDir(a.root, sdir)
	if err != nil {
		return err
	}
	if sparent == "" {
		sparent = "."
	}
	if path.Join(sparent, sbase) == target {
		return nil
	}
	sf, err := a.root.Open(sparent)
	if err != nil {
		return fmt.Errorf("hard link source %q: %w", linkname, err)
	}
	defer sf.Close()
	var st unix.Stat_t
	if err := unix.Fstatat(int(sf.Fd()), sbase, &st, unix.AT_SYMLINK_NOFOLLOW); err != nil {
		return fmt.Errorf("hard link source %q: %w", linkname, err)
	}
	if st.Mode&unix.S_IFMT == unix.S_IFDIR {
		return fmt.Errorf("%w: hard link to directory %q", ErrUnsupported, linkname)
	}
	// linkat without AT_SYMLINK_FOLLOW links a symlink itself, as tar means.
	if err := unix.Linkat(int(sf.Fd()), sbase, dfd, base, 0); err != nil {
		return fmt.Errorf("hard link: %w", err)
	}
	return nil
}

// opaque empties dir of everything this layer did not write: after the
// layer, an opaque directory holds exactly the layer's own entries.
func (a *applier) opaque(dir string) error {
	if _, err := a.root.Lstat(dir); errors.Is(err, fs.ErrNotExist) {
		return nil
	}
	return a.prune(dir)
}

func (a *applier) prune(dir string) error {
	f, err := a.root.Open(dir)
	if err != nil {
		return fmt.Errorf("opaque dir: %w", err)
	}
	names, err := f.Readdirnames(-1)
	f.Close()
	if err != nil {
		return fmt.Errorf("opaque dir: %w", err)
	}
	for _, n := range names {
		p := path.Join(dir, n)
		if p == "." {
			continue
		}
		switch {
		case a.seen[p] && !a.ancestor[p]:
		case a.ancestor[p]:
			fi, err := a.root.Lstat(p)
			if err != nil {
				return err
			}
			if fi.IsDir() {
				if err := a.prune(p); err != nil {
					return err
				}
			}
		default:
			if err := a.root.RemoveAll(p); err != nil {
				return fmt.Errorf("opaque dir: %w", err)
			}
		}
	}
	return nil
}

// meta applies metadata to rel, reopening its parent.
func (a *applier) meta(rel string, h *tar.Header, isDir bool) error {
	if rel == "." {
		f, err := a.root.Open(".")
		if err != nil {
			return err
		}
		defer f.Close()
		return a.metaFD(int(f.Fd()), "", rel, h, isDir)
	}
	pf, err := a.root.Open(path.Dir(rel))
	if err != nil {
		return err
	}
	defer pf.Close()
	return a.metaAt(int(pf.Fd()), rel, path.Base(rel), h)
}

func (a *applier) metaAt(dfd int, rel, base string, h *tar.Header) error {
	return a.metaFD(dfd, base, rel, h, h.Typeflag == tar.TypeDir)
}

// metaFD applies ownership, mode, xattrs and times to base in the directory
// dfd (base "" = dfd itself), never following a symlink.
func (a *applier) metaFD(dfd int, base, rel string, h *tar.Header, isDir bool) error {
	flags := unix.AT_SYMLINK_NOFOLLOW
	if base == "" {
		flags |= unix.AT_EMPTY_PATH
	}
	if a.chown {
		if err := unix.Fchownat(dfd, base, h.Uid, h.Gid, flags); err != nil {
			return fmt.Errorf("chown: %w", err)
		}
	}
	symlink := h.Typeflag == tar.TypeSymlink
	if !symlink {
		// After chown: chown clears set-id bits. base is not a symlink (it was
		// just created as something else), so following is harmless.
		p := base
		if p == "" {
			p = "."
		}
		if err := unix.Fchmodat(dfd, p, uint32(h.Mode)&0o7777, 0); err != nil {
			return fmt.Errorf("chmod: %w", err)
		}
	}
	for k, v := range h.PAXRecords {
		name, ok := strings.CutPrefix(k, "SCHILY.xattr.")
		if !ok {
			continue
		}
		p := fmt.Sprintf("/proc/self/fd/%d", dfd)
		if base != "" {
			p += "/" + base
		}
		if err := unix.Lsetxattr(p, name, []byte(v), 0); err != nil {
			if errors.Is(err, unix.ENOTSUP) || errors.Is(err, unix.EPERM) || errors.Is(err, unix.EOPNOTSUPP) {
				a.st.Skipped++
				a.log.Debug("unpack: xattr skipped", "path", rel, "xattr", name, "err", err)
				continue
			}
			return fmt.Errorf("xattr %s: %w", name, err)
		}
	}
	atime := h.AccessTime
	if atime.IsZero() {
		atime = h.ModTime
	}
	if isDir {
		a.dirTimes = append(a.dirTimes, dirTime{rel: rel, atime: atime, mtime: h.ModTime})
		return nil
	}
	ts := []unix.Timespec{unix.NsecToTimespec(atime.UnixNano()), unix.NsecToTimespec(h.ModTime.UnixNano())}
	if err := unix.UtimesNanoAt(dfd, base, ts, unix.AT_SYMLINK_NOFOLLOW); err != nil {
		return fmt.Errorf("times: %w", err)
	}
	return nil
}

func (a *applier) setTimes(rel string, atime, mtime time.Time) error {
	dir, base := ".", ""
	if rel != "." {
		dir, base = path.Dir(rel), path.Base(rel)
	}
	f, err := a.root.Open(dir)
	if err != nil {
		return err
	}
	defer f.Close()
	ts := []unix.Timespec{unix.NsecToTimespec(atime.UnixNano()), unix.NsecToTimespec(mtime.UnixNano())}
	if base == "" {
		return unix.UtimesNanoAt(int(f.Fd()), ".", ts, 0)
	}
	return unix.UtimesNanoAt(int(f.Fd()), base, ts, unix.AT_SYMLINK_NOFOLLOW)
}
