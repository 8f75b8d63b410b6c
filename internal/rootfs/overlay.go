package rootfs

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"runtime"
	"strings"
	"sync"

	"github.com/aenv-dev/aenv/internal/image"
	"github.com/aenv-dev/aenv/internal/storage/blockdev"
	"github.com/aenv-dev/aenv/internal/storage/lsmt"
	"github.com/aenv-dev/aenv/internal/storage/stack"
	"golang.org/x/sys/unix"
)

// Overlay roots put the template's files in one page cache for every sandbox on it.
//
// A block root is an ext4 filesystem of its own, so each sandbox reads the template's
// binaries and libraries through FUSE into a page cache of its own: ~5 MiB for a first
// `bash -l -c` and ~4 ms of CPU (BenchmarkFirstRead), 25 GB for 5 000 sandboxes.
// An overlay root mounts the template's sealed layers once, read-only (Lowers), as the
// lower of every sandbox's overlay; what a sandbox writes goes to an upper filesystem
// that is a block root of its own (OverlaySpec.Upper), so it still snapshots and forks
// by sealing layers: a snapshot of an overlay root is the upper's sealed layers, opened
// again over the same lower.

// Lowers mounts each stack of sealed layers once, read-only, and shares the mount among
// the overlay roots over it. The mount goes when the last root over it is closed (its
// page cache with it). Safe for concurrent use.
type Lowers struct {
	dir      string
	open     Opener
	resolver stack.Resolver

	mu sync.Mutex
	m  map[string]*SharedLower
}

// NewLowers keeps its mounts in directories under dir (created if missing), serving
// their disks with open (nil: in this process) and opening layers that have no path
// with resolver (optional; see Spec.Resolver).
func NewLowers(dir string, open Opener, resolver stack.Resolver) *Lowers {
	if abs, err := filepath.Abs(dir); err == nil {
		dir = abs
	}
	return &Lowers{dir: dir, open: open, resolver: resolver, m: map[string]*SharedLower{}}
}

// Dir is the directory the lowers are mounted under.
func (ls *Lowers) Dir() string { return ls.dir }

// SharedLower is one stack mounted read-only for the overlay roots over it.
type SharedLower struct {
	key   string
	dir   string
	ready chan struct{} // closed once the mount is made or has failed
	err   error         // why it failed; set before ready closes
	blk   *Block
	refs  int // guarded by Lowers.mu
}

// Path is where the lower's filesystem is mounted (read-only).
func (l *SharedLower) Path() string { return filepath.Join(l.dir, "root") }

// Size is the lower's device size in bytes.
func (l *SharedLower) Size() int64 { return l.blk.Size() }

// lowerKey names a stack by its layers, in order: two roots share a lower only when
// their layers are the same files.
func lowerKey(layers []stack.LayerRef) string {
	h := sha256.New()
	for _, l := range layers {
		fmt.Fprintf(h, "%s\x00%s\x00%s\x00%d\n", l.Path, l.Digest, l.UUID, l.Size)
	}
	return hex.EncodeToString(h.Sum(nil))[:24]
}

// Acquire returns the stack's shared lower, mounting it when no root uses it yet; each
// successful Acquire is paired with a Release. Concurrent Acquires of one stack mount it
// once.
func (ls *Lowers) Acquire(ctx context.Context, layers []stack.LayerRef) (*SharedLower, error) {
	if len(layers) == 0 {
		return nil, errors.New("rootfs: a shared lower needs at least one layer")
	}
	key := lowerKey(layers)
	ls.mu.Lock()
	if l := ls.m[key]; l != nil {
		l.refs++
		ls.mu.Unlock()
		select {
		case <-l.ready:
		case <-ctx.Done():
			ls.Release(l)
			return nil, ctx.Err()
		}
		if l.err != nil {
			return nil, l.err
		}
		return l, nil
	}
	l := &SharedLower{key: key, ready: make(chan struct{}), refs: 1}
	ls.m[key] = l
	ls.mu.Unlock()

	l.err = ls.mount(ctx, l, layers)
	if l.err != nil {
		ls.mu.Lock()
		delete(ls.m, key)
		ls.mu.Unlock()
	}
	close(l.ready)
	if l.err != nil {
		return nil, l.err
	}
	return l, nil
}

func (ls *Lowers) mount(ctx context.Context, l *SharedLower, layers []stack.LayerRef) error {
	if err := os.MkdirAll(ls.dir, 0o755); err != nil {
		return fmt.Errorf("rootfs: %w", err)
	}
	// A directory of its own per mount: a lower released while a new Acquire of the same
	// stack mounts it again must not share a path with it.
	dir, err := os.MkdirTemp(ls.dir, l.key+"-")
	if err != nil {
		return fmt.Errorf("rootfs: %w", err)
	}
	l.dir = dir
	l.blk, err = Open(ctx, Spec{Dir: dir, Lowers: layers, Target: l.Path(), UserNS: -1, ReadOnly: true, Open: ls.open, Resolver: ls.resolver})
	if err != nil {
		os.RemoveAll(dir)
		return fmt.Errorf("rootfs: shared lower: %w", err)
	}
	return nil
}

// Release gives back one Acquire's use of l; the last one unmounts it.
func (ls *Lowers) Release(l *SharedLower) error {
	ls.mu.Lock()
	l.refs--
	last := l.refs == 0
	if last && ls.m[l.key] == l {
		delete(ls.m, l.key)
	}
	ls.mu.Unlock()
	if !last {
		return nil
	}
	<-l.ready // a waiter cancelled while the mount was made cannot be the last
	if l.blk == nil {
		return nil
	}
	// A lower still held by an overlay that is not closed yet (a root the node's restart
	// did not adopt, detached after the release) was detached: its disk is closed once
	// that overlay lets go, so it is no failure of the release.
	err := blockdev.WithoutStillInUse(l.blk.Close())
	if err == nil {
		err = os.RemoveAll(l.dir)
	}
	return err
}

// hold takes one more use of l for an overlay root, which only a holder of l may do.
func (ls *Lowers) hold(l *SharedLower) error {
	ls.mu.Lock()
	defer ls.mu.Unlock()
	if ls.m[l.key] != l || l.refs == 0 {
		return errors.New("rootfs: overlay root over a lower that is not held")
	}
	l.refs++
	return nil
}

// Adopt takes over a shared lower that a previous process mounted and whose disk the data
// plane still serves; it counts as an Acquire. Adopt each lower before the overlay roots
// over it (AdoptOverlay), then Release it: a lower that no root was adopted over is
// unmounted then. On error nothing is changed.
func (ls *Lowers) Adopt(disk ServedDisk, mounts blockdev.Mounts) (*SharedLower, error) {
	dir := disk.Dir()
	key := lowerKey(disk.Lowers())
	if filepath.Dir(dir) != ls.dir || !strings.HasPrefix(filepath.Base(dir), key+"-") {
		return nil, fmt.Errorf("rootfs: adopt %s: not a shared lower of %s for its layers", dir, ls.dir)
	}
	l := &SharedLower{key: key, dir: dir, ready: make(chan struct{}), refs: 1}
	close(l.ready)
	ls.mu.Lock()
	defer ls.mu.Unlock()
	if ls.m[key] != nil {
		return nil, fmt.Errorf("rootfs: adopt %s: its layers are mounted already (%s)", dir, ls.m[key].dir)
	}
	blk, err := Adopt(disk, l.Path(), mounts)
	if err != nil {
		return nil, err
	}
	l.blk = blk
	ls.m[key] = l
	return l, nil
}

// Forget makes the next Acquire of any stack mount it anew; the lowers mounted now go
// when their last user releases them. For lowers whose disks died (the data plane's
// crash).
func (ls *Lowers) Forget() {
	ls.mu.Lock()
	defer ls.mu.Unlock()
	clear(ls.m)
}

// Abandon lets go of every lower's handles without unmounting or closing anything: what
// a crash of the process does (tests use it).
func (ls *Lowers) Abandon() {
	ls.mu.Lock()
	defer ls.mu.Unlock()
	for k, l := range ls.m {
		if l.blk != nil {
			l.blk.Abandon()
		}
		delete(ls.m, k)
	}
}

// OverlaySpec describes one overlay root.
type OverlaySpec struct {
	// Dir is private to this root: the upper's disk and mount, the lower's id-mapped view.
	Dir string
	// Lower is the shared read-only lower; the root holds its own Acquire of it.
	Lower *SharedLower
	// Upper are the upper filesystem's sealed layers, bottom first: an EmptyUpper layer,
	// then what snapshots of the root sealed.
	Upper []stack.LayerRef
	// VirtualSize, UserNS, Open, Resolver and MaxDirty are the upper's, as in Spec;
	// UserNS id-maps the lower's view too.
	VirtualSize uint64
	UserNS      int
	Resolver    stack.Resolver
	// RootID is the host id UserNS maps its root to (ignored without UserNS): the
	// overlay's own work in the upper is done as that id (see mountOverlay).
	RootID   int
	Open     Opener
	MaxDirty uint64
	// Target is where the overlay is mounted (created if missing).
	Target string
}

// Overlay is a mounted overlay root. Close releases it; the upper's files stay in Dir.
// What a crash leaves of one: the overlay at Target and the lower's view in Dir, which
// whoever owns them unmounts (the OCI backend's bundle teardown does), and the upper's
// and the lower's block devices, which Sweep of their directories removes.
type Overlay struct {
	lowers *Lowers
	lower  *SharedLower
	upper  *Block
	dir    string
	target string
}

func (l OverlaySpec) upperDir() string  { return OverlayUpperDir(l.Dir) }
func (l OverlaySpec) upperFS() string   { return filepath.Join(l.Dir, "upperfs") }
func (l OverlaySpec) lowerView() string { return filepath.Join(l.Dir, "lower") }

// OverlayUpperDir is the directory of the upper's disk of the overlay root whose
// OverlaySpec.Dir is dir: the data plane knows the disk by it.
func OverlayUpperDir(dir string) string { return filepath.Join(dir, "upperdisk") }

// OpenOverlay opens the upper's layers as a block root of its own and mounts the overlay
// of it on the shared lower at spec.Target; it takes a use of spec.Lower (ls must be the
// Lowers it came from), given back by Close. On error nothing stays mounted or served
// and the lower's use is given back.
func (ls *Lowers) OpenOverlay(ctx context.Context, spec OverlaySpec) (o *Overlay, err error) {
	if spec.Lower == nil {
		return nil, errors.New("rootfs: overlay root without a lower")
	}
	if len(spec.Upper) == 0 {
		return nil, errors.New("rootfs: overlay root without upper layers (make one with EmptyUpper)")
	}
	if spec.Dir, err = filepath.Abs(spec.Dir); err != nil {
		return nil, fmt.Errorf("rootfs: %w", err)
	}
	if err := ls.hold(spec.Lower); err != nil {
		return nil, err
	}
	o = &Overlay{lowers: ls, lower: spec.Lower, dir: spec.Dir, target: spec.Target}
	defer func() {
		if err != nil {
			err = errors.Join(err, o.Close())
		}
	}()
	o.upper, err = Open(ctx, Spec{Dir: spec.upperDir(), Lowers: spec.Upper, VirtualSize: spec.VirtualSize,
		Target: spec.upperFS(), UserNS: spec.UserNS, Open: spec.Open, Resolver: spec.Resolver, MaxDirty: spec.MaxDirty})
	if err != nil {
		return o, err
	}
	for _, d := range []string{"upper", "work"} {
		if _, err := os.Stat(filepath.Join(spec.upperFS(), d)); err != nil {
			return o, fmt.Errorf("rootfs: the upper layers hold no %s directory (not made by EmptyUpper): %w", d, err)
		}
	}
	lower, owner := spec.Lower.Path(), -1
	if spec.UserNS >= 0 {
		if err := idmappedView(lower, spec.lowerView(), spec.UserNS); err != nil {
			return o, err
		}
		lower, owner = spec.lowerView(), spec.RootID
	}
	if err := os.MkdirAll(spec.Target, 0o755); err != nil {
		return o, fmt.Errorf("rootfs: %w", err)
	}
	// redirect_dir lets a sandbox rename a directory of the lower (the kernel's default
	// may refuse with EXDEV); index stays off because it records the lower's file handles,
	// and a snapshot's upper is opened over another mount of the lower.
	opts := fmt.Sprintf("lowerdir=%s,upperdir=%s,workdir=%s,redirect_dir=on,index=off",
		EscapeOverlay(lower), EscapeOverlay(filepath.Join(spec.upperFS(), "upper")), EscapeOverlay(filepath.Join(spec.upperFS(), "work")))
	if err := mountOverlay(spec.Target, opts, owner); err != nil {
		return o, err
	}
	return o, nil
}

// AdoptOverlay takes over an overlay root a previous process opened (as spec describes
// it: Dir, Target and Lower, which must be held, as Adopt leaves it) and that still runs:
// its upper's disk, which the data plane still serves, is upperDisk; mounts is the mount
// table read once for every root adopted. On error nothing is changed.
func (ls *Lowers) AdoptOverlay(spec OverlaySpec, upperDisk ServedDisk, mounts blockdev.Mounts) (*Overlay, error) {
	if spec.Lower == nil {
		return nil, errors.New("rootfs: adopt an overlay root without its lower")
	}
	var err error
	if spec.Dir, err = filepath.Abs(spec.Dir); err != nil {
		return nil, fmt.Errorf("rootfs: %w", err)
	}
	if upperDisk.Dir() != spec.upperDir() {
		return nil, fmt.Errorf("rootfs: adopt %s: the upper's disk is %s, not %s", spec.Target, upperDisk.Dir(), spec.upperDir())
	}
	if t := mounts.FSType(spec.Target); t != "overlay" {
		return nil, fmt.Errorf("rootfs: adopt %s: no overlay mounted there (%q)", spec.Target, t)
	}
	upper, err := Adopt(upperDisk, spec.upperFS(), mounts)
	if err != nil {
		return nil, err
	}
	if err := ls.hold(spec.Lower); err != nil {
		upper.Abandon()
		return nil, err
	}
	return &Overlay{lowers: ls, lower: spec.Lower, upper: upper, dir: spec.Dir, target: spec.Target}, nil
}

// Abandon lets go of this process's handles on the root without unmounting or closing
// anything, and forgets its use of the lower: what a crash does (tests use it).
func (o *Overlay) Abandon() {
	if o.upper != nil {
		o.upper.Abandon()
	}
	o.upper, o.lower, o.target = nil, nil, ""
}

// idmappedView mounts a read-only, id-mapped clone of src's mount at dst.
func idmappedView(src, dst string, userns int) error {
	if err := os.MkdirAll(dst, 0o755); err != nil {
		return fmt.Errorf("rootfs: %w", err)
	}
	fd, err := unix.OpenTree(unix.AT_FDCWD, src, unix.OPEN_TREE_CLONE|unix.OPEN_TREE_CLOEXEC)
	if err != nil {
		return fmt.Errorf("rootfs: open_tree %s: %w", src, err)
	}
	defer unix.Close(fd)
	attr := &unix.MountAttr{Attr_set: unix.MOUNT_ATTR_IDMAP | unix.MOUNT_ATTR_RDONLY, Userns_fd: uint64(userns)}
	if err := unix.MountSetattr(fd, "", unix.AT_EMPTY_PATH, attr); err != nil {
		return fmt.Errorf("rootfs: id-map %s: %w", src, err)
	}
	if err := unix.MoveMount(fd, "", unix.AT_FDCWD, dst, unix.MOVE_MOUNT_F_EMPTY_PATH); err != nil {
		return fmt.Errorf("rootfs: move_mount to %s: %w", dst, err)
	}
	return nil
}

// EscapeOverlay escapes p for an overlay mount's lowerdir, upperdir or workdir option,
// whose values are separated by ',' and ':'.
func EscapeOverlay(p string) string {
	return strings.NewReplacer(`\`, `\\`, `,`, `\,`, `:`, `\:`).Replace(p)
}

// Upper is the root's upper filesystem, a block root of its own.
func (o *Overlay) Upper() *Block { return o.upper }

// Lower is the shared lower the root is mounted over.
func (o *Overlay) Lower() *SharedLower { return o.lower }

// Snapshot seals the upper filesystem's current state (see Block.Snapshot) and returns
// its layers: OpenOverlay over the same lower with them as Upper gives the root as it
// was. The overlay writes through to the upper's page cache, which the upper's syncfs
// and freeze cover.
func (o *Overlay) Snapshot(ctx context.Context, output string, q Quiesce) ([]stack.LayerRef, SnapshotTimes, error) {
	if o.upper == nil {
		return nil, SnapshotTimes{}, errors.New("rootfs: snapshot of a closed overlay root")
	}
	return o.upper.Snapshot(ctx, output, q)
}

// Close unmounts the overlay and the lower's view, closes the upper and gives back the
// lower's use. It is idempotent.
func (o *Overlay) Close() error {
	var errs []error
	if o.target != "" {
		errs = append(errs, unmount(o.target), unmount(filepath.Join(o.dir, "lower")))
		o.target = ""
	}
	if o.upper != nil {
		errs = append(errs, o.upper.Close())
		o.upper = nil
	}
	if o.lower != nil {
		errs = append(errs, o.lowers.Release(o.lower))
		o.lower = nil
	}
	return errors.Join(errs...)
}

// EmptyUpper returns the sealed layer of an empty upper filesystem of sizeMB MiB (with
// the overlay's upper and work directories, owned by root), made at dir/empty-upper-
// <size>.commit unless it is there already.
func EmptyUpper(ctx context.Context, dir string, sizeMB int) (stack.LayerRef, error) {
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return stack.LayerRef{}, fmt.Errorf("rootfs: %w", err)
	}
	path := filepath.Join(dir, fmt.Sprintf("empty-upper-%dM.commit", sizeMB))
	if ref, err := layerRef(path); err == nil {
		return ref, nil
	}
	src, err := os.MkdirTemp(dir, ".empty-upper-")
	if err != nil {
		return stack.LayerRef{}, fmt.Errorf("rootfs: %w", err)
	}
	defer os.RemoveAll(src)
	for _, d := range []string{"fs/upper", "fs/work"} {
		if err := os.MkdirAll(filepath.Join(src, d), 0o755); err != nil {
			return stack.LayerRef{}, fmt.Errorf("rootfs: %w", err)
		}
	}
	raw := filepath.Join(src, "raw")
	if err := image.BuildExt4(ctx, filepath.Join(src, "fs"), raw, sizeMB); err != nil {
		return stack.LayerRef{}, fmt.Errorf("rootfs: empty upper: %w", err)
	}
	in, err := os.Open(raw)
	if err != nil {
		return stack.LayerRef{}, fmt.Errorf("rootfs: %w", err)
	}
	defer in.Close()
	tmp := filepath.Join(src, "commit")
	out, err := os.Create(tmp)
	if err != nil {
		return stack.LayerRef{}, fmt.Errorf("rootfs: %w", err)
	}
	_, err = lsmt.Import(out, in, lsmt.CommitOptions{})
	if err == nil {
		err = out.Sync()
	}
	if cerr := out.Close(); err == nil {
		err = cerr
	}
	if err == nil {
		// A link, not a rename: a concurrent call that got there first keeps its file,
		// which roots may already have opened by its UUID.
		if err = os.Link(tmp, path); errors.Is(err, os.ErrExist) {
			err = nil
		}
	}
	if err != nil {
		return stack.LayerRef{}, fmt.Errorf("rootfs: empty upper: %w", err)
	}
	return layerRef(path)
}

// layerRef describes the sealed layer at path.
func layerRef(path string) (stack.LayerRef, error) {
	f, err := os.Open(path)
	if err != nil {
		return stack.LayerRef{}, err
	}
	defer f.Close()
	st, err := f.Stat()
	if err != nil {
		return stack.LayerRef{}, err
	}
	hb := make([]byte, lsmt.HeaderSize)
	if _, err := f.ReadAt(hb, 0); err != nil {
		return stack.LayerRef{}, fmt.Errorf("rootfs: %s: %w", path, err)
	}
	h, err := lsmt.ParseHeader(hb)
	if err != nil {
		return stack.LayerRef{}, fmt.Errorf("rootfs: %s: %w", path, err)
	}
	return stack.LayerRef{Path: path, Size: st.Size(), UUID: h.UUID}, nil
}

// secbitNoSetuidFixup keeps a thread's capabilities when its fsuid leaves 0
// (SECBIT_NO_SETUID_FIXUP, linux/securebits.h).
const secbitNoSetuidFixup = 1 << 2

// mountOverlay mounts the overlay described by opts at target. The kernel's overlay does
// its own work in the upper (the work directory, copy-ups, whiteouts) with the
// credentials of whoever mounted it; on an id-mapped upper, host root is an id the
// mapping does not cover, and every such write fails with EOVERFLOW (the overlay then
// mounts read-only). With owner >= 0 the mount is made from a thread whose fsuid and
// fsgid are owner (the host id the mapping gives on-disk root), capabilities kept, so
// what the overlay writes for itself is owned by the sandbox's root on disk.
func mountOverlay(target, opts string, owner int) error {
	mount := func() error {
		if err := unix.Mount("overlay", target, "overlay", unix.MS_NODEV|unix.MS_NOATIME, opts); err != nil {
			return fmt.Errorf("rootfs: mount overlay on %s: %w", target, err)
		}
		return nil
	}
	if owner < 0 {
		return mount()
	}
	errc := make(chan error, 1)
	go func() {
		// Credentials are per thread: the change stays on this one, which goes back to
		// Go's pool only once they are restored (a thread left locked ends with the
		// goroutine).
		runtime.LockOSThread()
		restored, err := AsOwner(owner, mount)
		if restored {
			runtime.UnlockOSThread()
		}
		errc <- err
	}()
	return <-errc
}

// AsOwner runs fn on the calling thread with its fsuid and fsgid set to owner and its
// capabilities kept (SECBIT_NO_SETUID_FIXUP), then puts them back: what fn creates is
// owned by owner on disk, and it may still do what needs capabilities (a file system of
// a user namespace that maps owner but not host root). Credentials are per thread: the
// caller has locked it (runtime.LockOSThread) and may let it go back to Go's pool only
// when restored reports that everything was put back.
func AsOwner(owner int, fn func() error) (restored bool, err error) {
	bits, err := unix.PrctlRetInt(unix.PR_GET_SECUREBITS, 0, 0, 0, 0)
	if err != nil {
		return true, fmt.Errorf("rootfs: securebits: %w", err)
	}
	if err := unix.Prctl(unix.PR_SET_SECUREBITS, uintptr(bits|secbitNoSetuidFixup), 0, 0, 0); err != nil {
		return true, fmt.Errorf("rootfs: keep capabilities as id %d: %w", owner, err)
	}
	unix.RawSyscall(unix.SYS_SETFSGID, uintptr(owner), 0, 0)
	unix.RawSyscall(unix.SYS_SETFSUID, uintptr(owner), 0, 0)
	err = fn()
	unix.RawSyscall(unix.SYS_SETFSUID, 0, 0, 0)
	unix.RawSyscall(unix.SYS_SETFSGID, 0, 0, 0)
	perr := unix.Prctl(unix.PR_SET_SECUREBITS, uintptr(bits), 0, 0, 0)
	// setfsuid answers with the previous id whatever it did; an invalid id changes nothing.
	fsuid, _, _ := unix.RawSyscall(unix.SYS_SETFSUID, ^uintptr(0), 0, 0)
	fsgid, _, _ := unix.RawSyscall(unix.SYS_SETFSGID, ^uintptr(0), 0, 0)
	return perr == nil && fsuid == 0 && fsgid == 0, err
}
