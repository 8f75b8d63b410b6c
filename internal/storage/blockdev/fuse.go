// Package blockdev exposes a virtual block device (e.g. a *stack.Stack) to
// the kernel: as a single file in a FUSE filesystem, and as a loop device
// over that file that ext4 or a VMM can open. It also sweeps what a crashed
// process left behind.
package blockdev

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"os"
	"path/filepath"
	"runtime"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/hanwen/go-fuse/v2/fs"
	"github.com/hanwen/go-fuse/v2/fuse"
	"golang.org/x/sys/unix"
)

// Device is what the frontend serves. *stack.Stack implements it.
type Device interface {
	ReadAt(p []byte, off int64) (int, error)
	WriteAt(p []byte, off int64) (int, error)
	Discard(off, n int64) error
	Sync() error
	Size() int64
}

// FileName is the name of the device file inside a FUSE mount.
const FileName = "disk"

// fsName marks our mounts in /proc/self/mountinfo (their source) so Sweep finds them;
// fsType is their filesystem type.
const (
	fsName  = "aenv-blockdev"
	fsType  = "fuse." + subtype
	subtype = "aenv"
)

// maxWrite is the largest FUSE request (read or write) the kernel sends. It also sizes
// go-fuse's request buffers: every server allocates one maxWrite-sized buffer per request
// in flight (up to GOMAXPROCS readers plus the requests being served) in a per-server
// sync.Pool that the runtime keeps reachable for a GC cycle after the server stops. At
// 1 MiB that was 3.7 MB of buffers per sandbox lifecycle with GOMAXPROCS=2 and 6.5 MB
// with 16, which, counted live at each GC, drove a churning node's heap goal up to
// hundreds of MB with ~10 MB truly live. 256 KiB cut that by 4 at no measured cost
// (BenchmarkExt4Sequential: write within noise, uncached read faster). 128 KiB: each
// idle disk keeps IdleReaders request buffers resident, and what limits a node's density
// is memory: the data plane held 0.54 instead of 0.75 MiB per idle disk (fills of 600),
// for 2-5 % more CPU per 1 MiB O_DIRECT sequential read (BenchmarkRootIO, data plane
// 351 against 334 µs, medians of 5; random 4 KiB I/O unchanged).
const maxWrite = 128 << 10

// IdleReaders is how many goroutines of one mount wait in read(2) on /dev/fuse or serve a
// write at most (see requestBudget): what an idle mount keeps, each with an OS thread
// and a request buffer. go-fuse parks each reader goroutine in a blocking read(2), and
// Go counts a goroutine in a syscall as holding its P. Left to itself go-fuse keeps up to
// GOMAXPROCS+1 readers, so between two requests every P is held by a blocked reader: the
// runtime's monitor (sysmon) then takes a P back from a reader on each of its 20 µs ticks
// and hands it to a thread that finds nothing to do and sleeps again, and the reader
// that gets the next request returns from read(2) without a P and wakes the monitor to
// get one. Measured serving 4 KiB reads on a 2-vCPU host, that was ~7 context switches
// per request in the data plane instead of ~1.5. A process serving mounts therefore runs
// with at least ServingProcs Ps, so that the readers and requests of one busy mount
// leave Ps free.
//
// Two, not one: with a single reader go-fuse starts a goroutine for every request it
// reads (it does so whenever no other reader is left waiting) and the one that served
// it exits, a thread handoff per request: BenchmarkRootIO measured 3 sleeps per 4 KiB
// request in the data plane instead of 1.5 and 20-45 % more of its CPU per request.
// With two, the reader that served a request goes back to waiting while the other takes
// the next one. Four (the cap before) kept ~3.4 threads and buffers per idle disk.
const IdleReaders = 2

// ServingProcs is the GOMAXPROCS a process serving mounts should run with at least.
// It is what the cap of 4 waiting readers needed (and measured fastest), kept as is.
func ServingProcs() int { return 6 }

// requestBudget is the go-fuse MaxInflightRequestBytes of a mount: room for IdleReaders
// request input buffers (maxWrite plus the largest header plus a page, go-fuse's
// readBufBytes, each with its request struct) and not for one more, plus room for the
// request structs (about a KiB each) of the reads being served. go-fuse reserves a whole
// input buffer for every goroutine waiting in read(2) and for every write being served
// (the write keeps its buffer); a read or any other small request gives its buffer back
// as soon as it is read and keeps only its struct, so reads are served concurrently,
// as many as arrive. A goroutine that finishes a request when the budget has no room
// for its buffer exits: after a burst a mount shrinks back to IdleReaders waiting
// readers, threads and buffers (each buffer resident, go-fuse's pool hands out zeroed
// recycled memory).
const requestBudget = IdleReaders*maxWrite + 128<<10

// Mount is a FUSE filesystem serving one device as the file FileName.
type Mount struct {
	dir    string
	server *fuse.Server
	root   *rootNode
	done   chan struct{} // closed once the server has stopped (made by the first Close)
}

// ErrStillInUse is Close's answer when the mount was detached but something (a lingering
// filesystem on a loop device, typically one whose last user is still exiting) keeps
// the device file open: the server goes on serving it and stops by itself once that user
// lets go (Done is closed then). Nothing is leaked; the device is just not free yet.
var ErrStillInUse = errors.New("detached lazily but still in use")

// WithoutStillInUse returns err without its ErrStillInUse parts (err may join several
// errors): for callers discarding a device, for whom a device that frees itself later is
// no failure.
func WithoutStillInUse(err error) error {
	if errors.Is(err, ErrStillInUse) {
		if j, ok := err.(interface{ Unwrap() []error }); ok {
			var rest []error
			for _, e := range j.Unwrap() {
				if e = WithoutStillInUse(e); e != nil {
					rest = append(rest, e)
				}
			}
			return errors.Join(rest...)
		}
		return nil
	}
	return err
}

// MountOptions tune the FUSE mount.
type MountOptions struct {
	ReadOnly bool
	// NoWritebackCache disables the kernel's FUSE writeback cache (on by
	// default: it batches small writes into larger ones).
	NoWritebackCache bool
	// BufferedLoop makes Expose attach its loop device buffered instead of with
	// direct I/O (LoopOptions.DirectIO).
	BufferedLoop bool
}

// MountFile mounts dir (created if missing) as a filesystem of the one file FileName
// serving dev (see mountFUSE).
func MountFile(ctx context.Context, dir string, dev Device, o MountOptions) (*Mount, error) {
	root := &rootNode{dev: dev, ro: o.ReadOnly}
	server, err := mountFUSE(dir, root, fuseOptions{readOnly: o.ReadOnly, writeback: !o.NoWritebackCache && !o.ReadOnly,
		budget: requestBudget})
	if err != nil {
		return nil, err
	}
	m := &Mount{dir: dir, server: server, root: root}
	if err := pollHack(dir); err != nil {
		return nil, errors.Join(err, m.Close())
	}
	slog.Debug("blockdev: fuse mounted", "dir", dir)
	return m, nil
}

// fuseOptions are what differs between a one-device mount and a shared one.
type fuseOptions struct {
	readOnly, writeback bool
	// budget is go-fuse's MaxInflightRequestBytes (see requestBudget).
	budget int
	// maxBackground is the kernel's max_background of the connection; 0 keeps go-fuse's.
	maxBackground int
}

// mountFUSE mounts dir (created if missing) with root as its root node and starts serving
// it, without fusermount.
//
// It opens /dev/fuse and calls mount(2) itself rather than letting go-fuse do it: go-fuse's
// direct mount opens /dev/fuse without O_CLOEXEC, so every process the node starts (runc,
// resize2fs) would inherit the connection, and one that outlives the node (an orphaned
// `runc create`) keeps the connection open with no server, which wedges the loop device
// and ext4 above it. go-fuse gets the descriptor through its /dev/fd/N convention.
func mountFUSE(dir string, root fs.InodeEmbedder, o fuseOptions) (*fuse.Server, error) {
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return nil, fmt.Errorf("blockdev: %w", err)
	}
	var st unix.Stat_t
	if err := unix.Stat(dir, &st); err != nil {
		return nil, fmt.Errorf("blockdev: %w", err)
	}
	fd, err := unix.Open("/dev/fuse", unix.O_RDWR|unix.O_CLOEXEC, 0)
	if err != nil {
		return nil, fmt.Errorf("blockdev: open /dev/fuse: %w", err)
	}
	defer unix.Close(fd)
	flags := uintptr(unix.MS_NOSUID | unix.MS_NODEV)
	if o.readOnly {
		flags |= unix.MS_RDONLY
	}
	data := fmt.Sprintf("fd=%d,rootmode=%o,user_id=%d,group_id=%d,max_read=%d,allow_other",
		fd, st.Mode&unix.S_IFMT, os.Geteuid(), os.Getegid(), maxWrite)
	if err := unix.Mount(fsName, dir, fsType, flags, data); err != nil {
		return nil, fmt.Errorf("blockdev: mount fuse at %s: %w", dir, err)
	}
	// go-fuse closes the descriptor it serves on some error paths; a copy of its own
	// keeps ours (closed on return) from ever closing a number reused meanwhile.
	srvFd, err := unix.FcntlInt(uintptr(fd), unix.F_DUPFD_CLOEXEC, 0)
	if err != nil {
		return nil, errors.Join(fmt.Errorf("blockdev: dup fuse fd: %w", err), lazyUnmount(dir))
	}
	sec := time.Hour
	mo := fuse.MountOptions{
		FsName:        fsName,
		Name:          subtype,
		AllowOther:    true,
		MaxWrite:      maxWrite,
		MaxReadAhead:  maxWrite,
		MaxBackground: o.maxBackground,
		DisableXAttrs: true,
		// Every read is answered from memory (ReadResultData), which go-fuse cannot
		// splice: with splicing on it still writes each reply's header into a pipe,
		// finds it has no file to splice from, writes the reply normally and drains the
		// pipe (a splice and an ioctl). That was 3 of the 6 syscalls of every 4 KiB read.
		DisableSplice:           true,
		MaxInflightRequestBytes: o.budget,
	}
	if o.writeback {
		mo.ExtraCapabilities = fuse.CAP_WRITEBACK_CACHE
	}
	server, err := fs.Mount(fmt.Sprintf("/dev/fd/%d", srvFd), root, &fs.Options{MountOptions: mo, AttrTimeout: &sec, EntryTimeout: &sec})
	if err != nil {
		return nil, errors.Join(fmt.Errorf("blockdev: serve fuse at %s: %w", dir, err), lazyUnmount(dir))
	}
	return server, nil
}

// pollHack does what go-fuse's WaitMount does for mounts it made itself (it cannot for a
// /dev/fd/N mount): it polls go-fuse's magic file once so the server answers ENOSYS and
// the kernel stops sending POLL. Otherwise the Go runtime adding a file of this mount to
// its epoll set (any open by this process) would send POLL to this same process, whose
// server may need that very thread: the process deadlocks.
func pollHack(dir string) error {
	fd, err := unix.Open(filepath.Join(dir, ".go-fuse-epoll-hack"), unix.O_RDONLY|unix.O_CLOEXEC, 0)
	if err != nil {
		return fmt.Errorf("blockdev: fuse poll probe in %s: %w", dir, err)
	}
	defer unix.Close(fd)
	_, _ = unix.Poll([]unix.PollFd{{Fd: int32(fd), Events: unix.POLLIN | unix.POLLPRI | unix.POLLOUT}}, 0)
	return nil
}

// Path is the device file's path.
func (m *Mount) Path() string { return filepath.Join(m.dir, FileName) }

// Close unmounts the filesystem and waits for the server to stop. A busy
// mount (e.g. a loop device still attached) is detached lazily so nothing
// stays visible; if it is still held after a few seconds Close returns
// ErrStillInUse and the server keeps serving the remaining users until they go.
func (m *Mount) Close() error {
	if m.server == nil {
		return nil
	}
	var err error
	// A loop device just detached lets go of its backing file a moment later (the
	// kernel defers the final fput), so a first EBUSY is often transient.
	for delay, try := 5*time.Millisecond, 0; try < 5; delay, try = 2*delay+5*time.Millisecond, try+1 {
		if err = unix.Unmount(m.dir, 0); err == nil || !errors.Is(err, unix.EBUSY) {
			break
		}
		time.Sleep(delay)
	}
	if err != nil && !errors.Is(err, unix.EINVAL) {
		if e := lazyUnmount(m.dir); e != nil {
			return fmt.Errorf("blockdev: unmount %s: %w (lazy: %w)", m.dir, err, e)
		}
	}
	if m.done == nil {
		m.done = make(chan struct{})
		srv := m.server
		go func() {
			srv.Wait()
			m.release()
			close(m.done)
		}()
	}
	select {
	case <-m.done:
		m.server = nil
		return nil
	case <-time.After(5 * time.Second):
		return fmt.Errorf("blockdev: %s: %w", m.dir, ErrStillInUse)
	}
}

// Done is closed once the server has stopped serving after Close (never before Close).
// After Close answered ErrStillInUse, it says when the last user let go.
func (m *Mount) Done() <-chan struct{} {
	if m.done == nil {
		return make(chan struct{})
	}
	return m.done
}

// release drops the nodes' references to the device once the server has stopped.
// go-fuse keeps its request buffers in per-server sync.Pools, and the runtime's pool
// registry keeps a pool (and, through its New func, the whole server and its node tree)
// reachable until the second GC after the server's last request. Without this, every
// retired sandbox root would pin its stack (layer indexes, caches, zfile buffers) for
// that extra cycle too, and the GC would count it as live: on a node churning sandboxes
// that inflates the heap goal with the state of every root closed since the last GC.
func (m *Mount) release() {
	if m.root == nil {
		return
	}
	m.root.dev = nil
	if m.root.file != nil {
		m.root.file.dev = nil
	}
	m.root = nil
}

func lazyUnmount(dir string) error {
	if err := unix.Unmount(dir, unix.MNT_DETACH); err != nil && !errors.Is(err, unix.EINVAL) {
		return fmt.Errorf("blockdev: lazy unmount %s: %w", dir, err)
	}
	return nil
}

type rootNode struct {
	fs.Inode
	dev  Device
	ro   bool
	file *fileNode // so Mount.release can reach the device reference it holds
}

var _ = (fs.NodeOnAdder)((*rootNode)(nil))

func (r *rootNode) OnAdd(ctx context.Context) {
	r.file = &fileNode{dev: r.dev, ro: r.ro, yield: &yielder{}}
	ch := r.NewPersistentInode(ctx, r.file, fs.StableAttr{Mode: syscall.S_IFREG, Ino: 2})
	r.AddChild(FileName, ch, false)
}

type fileNode struct {
	fs.Inode
	dev   Device
	ro    bool
	yield *yielder // shared by the files of one mount

	// gone, when set (a file of a shared mount), is closed once the file was removed and
	// every open of it released; opens counts them.
	gone    chan struct{}
	mu      sync.Mutex
	opens   int
	removed bool
}

// remove refuses later opens and closes gone once nothing has the file open.
func (f *fileNode) remove() {
	f.mu.Lock()
	defer f.mu.Unlock()
	if !f.removed {
		f.removed = true
		if f.opens == 0 {
			close(f.gone)
		}
	}
}

func (f *fileNode) release() {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.opens--
	if f.removed && f.opens == 0 {
		close(f.gone)
	}
}

// yielder makes the goroutines serving requests pass through the scheduler now and then.
// A reader goroutine loops on syscalls (read the request, serve it, reply) and never
// otherwise reschedules, so after 10 ms the runtime's monitor counts its P as running
// one goroutine too long and takes it back on every tick while the reader is blocked in
// read(2), which costs the same churn IdleReaders avoids. A yield at most every
// millisecond per mount (each of its readers yields every few ms) keeps that from
// happening, at no cost while the mount is idle.
type yielder struct{ last atomic.Int64 }

func (y *yielder) maybe() {
	now := time.Now().UnixNano()
	if l := y.last.Load(); now-l > int64(time.Millisecond) && y.last.CompareAndSwap(l, now) {
		runtime.Gosched()
	}
}

var (
	_ = (fs.NodeGetattrer)((*fileNode)(nil))
	_ = (fs.NodeSetattrer)((*fileNode)(nil))
	_ = (fs.NodeOpener)((*fileNode)(nil))
	_ = (fs.NodeReader)((*fileNode)(nil))
	_ = (fs.NodeWriter)((*fileNode)(nil))
	_ = (fs.NodeFsyncer)((*fileNode)(nil))
	_ = (fs.NodeFlusher)((*fileNode)(nil))
	_ = (fs.NodeAllocater)((*fileNode)(nil))
)

func (f *fileNode) Getattr(ctx context.Context, fh fs.FileHandle, out *fuse.AttrOut) syscall.Errno {
	out.Mode = 0o600
	if f.ro {
		out.Mode = 0o400
	}
	out.Size = uint64(f.dev.Size())
	out.Blocks = (out.Size + 511) / 512
	out.Blksize = 4096
	out.SetTimeout(time.Hour)
	return 0
}

// Setattr accepts only no-op size changes: a block device cannot be resized
// through its file.
func (f *fileNode) Setattr(ctx context.Context, fh fs.FileHandle, in *fuse.SetAttrIn, out *fuse.AttrOut) syscall.Errno {
	if sz, ok := in.GetSize(); ok && sz != uint64(f.dev.Size()) {
		return syscall.EINVAL
	}
	return f.Getattr(ctx, fh, out)
}

func (f *fileNode) Open(ctx context.Context, flags uint32) (fs.FileHandle, uint32, syscall.Errno) {
	if f.ro && flags&(syscall.O_WRONLY|syscall.O_RDWR) != 0 {
		return nil, 0, syscall.EROFS
	}
	if f.gone == nil {
		return nil, fuse.FOPEN_KEEP_CACHE, 0
	}
	f.mu.Lock()
	defer f.mu.Unlock()
	if f.removed {
		// Opened through a name the kernel still had cached.
		return nil, 0, syscall.ENOENT
	}
	f.opens++
	return &handle{f}, fuse.FOPEN_KEEP_CACHE, 0
}

func (f *fileNode) Read(ctx context.Context, fh fs.FileHandle, dest []byte, off int64) (fuse.ReadResult, syscall.Errno) {
	f.yield.maybe()
	n, err := f.dev.ReadAt(dest, off)
	if err != nil && !errors.Is(err, io.EOF) {
		slog.Error("blockdev: read", "off", off, "len", len(dest), "err", err)
		return nil, syscall.EIO
	}
	return fuse.ReadResultData(dest[:n]), 0
}

func (f *fileNode) Write(ctx context.Context, fh fs.FileHandle, data []byte, off int64) (uint32, syscall.Errno) {
	f.yield.maybe()
	if f.ro {
		return 0, syscall.EROFS
	}
	if off+int64(len(data)) > f.dev.Size() {
		return 0, syscall.ENOSPC
	}
	n, err := f.dev.WriteAt(data, off)
	if err != nil {
		slog.Error("blockdev: write", "off", off, "len", len(data), "err", err)
		return uint32(n), syscall.EIO
	}
	return uint32(n), 0
}

func (f *fileNode) Fsync(ctx context.Context, fh fs.FileHandle, flags uint32) syscall.Errno {
	if f.ro {
		return 0
	}
	if err := f.dev.Sync(); err != nil {
		slog.Error("blockdev: fsync", "err", err)
		return syscall.EIO
	}
	return 0
}

// Flush (close(2)) syncs too, so that detaching a loop device makes every
// write durable.
func (f *fileNode) Flush(ctx context.Context, fh fs.FileHandle) syscall.Errno {
	return f.Fsync(ctx, fh, 0)
}

const (
	fallocKeepSize  = 0x01
	fallocPunchHole = 0x02
)

// Allocate maps hole punching (what a loop device sends for discard) to
// Discard; plain preallocation is a no-op because the device is always
// fully addressable.
func (f *fileNode) Allocate(ctx context.Context, fh fs.FileHandle, off, size uint64, mode uint32) syscall.Errno {
	if f.ro {
		return syscall.EROFS
	}
	switch mode {
	case 0, fallocKeepSize:
		return 0
	case fallocPunchHole | fallocKeepSize:
		if end := uint64(f.dev.Size()); off >= end {
			return 0
		} else if off+size > end {
			size = end - off
		}
		if err := f.dev.Discard(int64(off), int64(size)); err != nil {
			slog.Error("blockdev: discard", "off", off, "len", size, "err", err)
			return syscall.EIO
		}
		return 0
	}
	return syscall.EOPNOTSUPP
}
