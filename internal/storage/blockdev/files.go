package blockdev

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"path/filepath"
	"strconv"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/hanwen/go-fuse/v2/fs"
)

// sharedReaders is how many request buffers (and the goroutines and threads waiting in
// read(2) with them) a shared mount keeps, and how many writes it serves at once (see
// requestBudget) for all the devices it serves together. A mount per device kept
// IdleReaders of each per device, ~0.35 MiB (two 136 KiB buffers, two threads) for every
// idle sandbox. More is not faster: every reader blocked in read(2) holds one of the
// process's Ps (see IdleReaders), and with 8 BenchmarkRootIO measured 70-80 % more of the
// data plane's CPU per 4 KiB request than a mount of its own (11.4 µs per random read);
// with 4, 12.3 µs (with 2, 12.6), medians of 5 interleaved runs.
const sharedReaders = 4

// sharedMaxBackground is the kernel's max_background of a shared connection: the
// asynchronous requests (a loop device's direct I/O, readahead) in flight on it at once,
// beyond which the kernel queues them. A connection per device had the default of 12
// each; a shared one must let a burst of devices read at once.
const sharedMaxBackground = 256

// Files is one FUSE filesystem serving many devices, each as a file of its own
// (see Add): one connection, one set of reader threads and buffers, and one mount table
// line for all of them, where MountFile costs each device its own.
type Files struct {
	dir   string
	mount *Mount // stopping the server is a one-device mount's, root aside
	root  *filesRoot
	next  atomic.Uint64
	yield yielder
}

type filesRoot struct{ fs.Inode }

// ServeFiles mounts an empty shared filesystem at dir (created if missing). A mount of
// this package's left at dir (by a process that died) is aborted and detached first:
// nothing can be served through it any more.
func ServeFiles(ctx context.Context, dir string) (*Files, error) {
	dir, err := filepath.Abs(dir)
	if err != nil {
		return nil, fmt.Errorf("blockdev: %w", err)
	}
	if err := clearMountsAt(dir); err != nil {
		return nil, err
	}
	f := &Files{dir: dir, root: &filesRoot{}}
	server, err := mountFUSE(dir, f.root, fuseOptions{writeback: true,
		budget: sharedReaders*maxWrite + 128<<10, maxBackground: sharedMaxBackground})
	if err != nil {
		return nil, err
	}
	f.mount = &Mount{dir: dir, server: server}
	if err := pollHack(dir); err != nil {
		return nil, errors.Join(err, f.Close())
	}
	return f, nil
}

// clearMountsAt aborts and detaches every mount of this package at dir.
func clearMountsAt(dir string) error {
	all, err := readMountinfo()
	if err != nil {
		return err
	}
	var errs []error
	for _, m := range all {
		if m.dir != dir || m.fstype != fsType || m.source != fsName {
			continue
		}
		slog.Warn("blockdev: a dead server's shared mount is in the way; detaching it", "dir", dir)
		errs = append(errs, abortConn(m.dev), lazyUnmount(dir))
	}
	return errors.Join(errs...)
}

// Close unmounts the filesystem (lazily when a file is still open) and stops serving it
// once its last user let go (see Mount.Close). Close every File first.
func (f *Files) Close() error { return f.mount.Close() }

// Add serves dev as a new file of the filesystem, named so that no file of this mount's
// life had the name before (a removed file's name may live on in a cache).
func (f *Files) Add(ctx context.Context, dev Device) (*File, error) {
	name := FileName + "." + strconv.FormatUint(f.next.Add(1), 10)
	node := &fileNode{dev: dev, yield: &f.yield, gone: make(chan struct{})}
	ino := f.root.NewPersistentInode(ctx, node, fs.StableAttr{Mode: syscall.S_IFREG})
	if !f.root.AddChild(name, ino, false) {
		return nil, fmt.Errorf("blockdev: %s: %s exists", f.dir, name)
	}
	return &File{files: f, name: name, node: node, ino: ino}, nil
}

// File is one device served by a Files.
type File struct {
	files *Files
	name  string
	node  *fileNode
	ino   *fs.Inode
	once  sync.Once
}

// Path is the device file's path.
func (d *File) Path() string { return filepath.Join(d.files.dir, d.name) }

// Close removes the file and waits until everything that had it open (a loop device, a
// VMM) has let go. When that takes more than a few seconds it returns ErrStillInUse and
// the file goes on being served to its remaining users; Done is closed once they let go.
func (d *File) Close() error {
	d.once.Do(func() {
		d.node.remove()
		d.files.root.RmChild(d.name)
		// The kernel caches the name for an hour (EntryTimeout): drop it, so the inode and
		// its pages go once the file is closed.
		_ = d.files.root.NotifyEntry(d.name)
		go func() {
			<-d.node.gone
			// Gone from the tree once the kernel forgets it too, and with it the
			// device's last reference.
			d.ino.ForgetPersistent()
		}()
	})
	select {
	case <-d.node.gone:
		return nil
	case <-time.After(5 * time.Second):
		return fmt.Errorf("blockdev: %s: %w", d.Path(), ErrStillInUse)
	}
}

// Done is closed once the file was closed and its last user let go.
func (d *File) Done() <-chan struct{} { return d.node.gone }

// handle is an open file: counted, so Close knows when the last user let go.
type handle struct{ n *fileNode }

var _ = (fs.FileReleaser)((*handle)(nil))

func (h *handle) Release(ctx context.Context) syscall.Errno {
	h.n.release()
	return 0
}
