// Package dataplane serves layer stacks to the kernel: each disk is a stack.Stack (sealed
// lowers plus a writable upper) exposed as one file in a FUSE mount, which a loop device
// (a sandbox's ext4 root) or a VMM (virtio-blk) opens. It also keeps each disk's upper
// flowing to the host's disk and takes the stack's part of a live snapshot (hold the
// syncs, seal and restack, make durable).
//
// The same Disk runs in two places. In-process (Local), as before the data plane
// existed: the disk dies with the process that opened it. In the data-plane daemon
// (`aenv dataplane`, Server), which the node starts in its own session and cgroup and
// reaches over a unix socket (Client): the disks then outlive a crash, restart or
// upgrade of the node, which lists them at its next start and adopts the sandboxes on
// them. See docs/operations.md, "The data plane".
package dataplane

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"path/filepath"
	"sync"
	"time"

	"github.com/aenv-dev/aenv/internal/storage/blockdev"
	"github.com/aenv-dev/aenv/internal/storage/stack"
)

// Names inside Spec.Dir.
const (
	upperData  = "upper.data"
	upperIndex = "upper.index"
	exposeDir  = "blk" // a disk's own FUSE mount point is blk/fuse, its file blk/fuse/disk
)

// DefaultMaxDirty is the upper growth the flusher lets build up before it starts
// writeback (half of it) or fsyncs (four times it); see Disk.flusher.
const DefaultMaxDirty = 16 << 20

// Spec describes one disk.
type Spec struct {
	// Dir is private to the disk: it holds the writable upper and the FUSE mount point.
	// It must be absolute and on the filesystem snapshots are sealed into. It is also
	// the disk's name in the data plane.
	Dir string `json:"dir"`
	// Lowers are the sealed layers, bottom first; paths are absolute.
	Lowers []stack.LayerRef `json:"lowers"`
	// VirtualSize is the device size in bytes (a multiple of 512); 0 keeps the lowers'.
	VirtualSize uint64 `json:"virtualSize,omitempty"`
	// MaxDirty paces the flusher (0 = DefaultMaxDirty).
	MaxDirty uint64 `json:"maxDirty,omitempty"`
}

// Validate checks what a disk needs before anything is opened.
func (s Spec) Validate() error {
	if !filepath.IsAbs(s.Dir) || filepath.Clean(s.Dir) != s.Dir {
		return fmt.Errorf("dataplane: disk dir %q is not a clean absolute path", s.Dir)
	}
	if len(s.Lowers) == 0 {
		return errors.New("dataplane: no lowers")
	}
	if s.VirtualSize%512 != 0 {
		return fmt.Errorf("dataplane: virtual size %d is not a multiple of 512", s.VirtualSize)
	}
	return nil
}

// UpperBytes is the size of the upper's data file of the disk in dir (what it wrote since
// its last snapshot, plus headers).
func UpperBytes(dir string) int64 {
	fi, err := os.Stat(filepath.Join(dir, upperData))
	if err != nil {
		return 0
	}
	return fi.Size()
}

// Disk is one served stack. All methods are safe for concurrent use.
type Disk struct {
	spec Spec
	st   *stack.Stack
	file servedFile
	log  *slog.Logger

	// wrote wakes the flusher: the FUSE file was written to (see notifying).
	wrote chan struct{}
	// flushMu keeps the flusher's fsyncs out of a snapshot's frozen window.
	flushMu  sync.Mutex
	stopSync chan struct{}
	synced   chan struct{}
	// snapMu makes snapshots of one disk take turns.
	snapMu    sync.Mutex
	closeOnce sync.Once
	closeErr  error
}

// Options are what OpenDisk takes besides the spec.
type Options struct {
	// Resolver opens lowers that have no path; it may be nil when all have one.
	Resolver stack.Resolver
	// Lowers, when set, shares the lower layers with the other disks opened with it.
	Lowers *stack.Lowers
	// Files, when set, serves the disk as a file of that shared mount; otherwise the disk
	// mounts a filesystem of its own in its directory.
	Files *blockdev.Files
	Log   *slog.Logger
}

// servedFile is how a disk's device file is served: a file of a shared mount
// (*blockdev.File) or a mount of its own (*blockdev.Mount).
type servedFile interface {
	Path() string
	// Close stops serving the file once its users let go; blockdev.ErrStillInUse when
	// they did not within a few seconds (Done says when they do).
	Close() error
	Done() <-chan struct{}
}

var (
	_ servedFile = (*blockdev.File)(nil)
	_ servedFile = (*blockdev.Mount)(nil)
)

// OpenDisk opens the stack of spec (creating an empty upper in spec.Dir when there is
// none), serves it through FUSE (see Options.Files) and starts its flusher.
func OpenDisk(ctx context.Context, spec Spec, o Options) (d *Disk, err error) {
	if err := spec.Validate(); err != nil {
		return nil, err
	}
	log := o.Log
	if log == nil {
		log = slog.Default()
	}
	if err := os.MkdirAll(spec.Dir, 0o711); err != nil {
		return nil, fmt.Errorf("dataplane: %w", err)
	}
	m := &stack.Manifest{
		Dir:         spec.Dir,
		VirtualSize: spec.VirtualSize,
		Lowers:      append([]stack.LayerRef(nil), spec.Lowers...),
		Upper:       &stack.Upper{Data: upperData, Index: upperIndex},
	}
	st, err := stack.Open(ctx, m, stack.Options{Resolver: o.Resolver, Lowers: o.Lowers})
	if err != nil {
		return nil, fmt.Errorf("dataplane: open stack: %w", err)
	}
	d = &Disk{spec: spec, st: st, log: log, wrote: make(chan struct{}, 1)}
	dev := notifying{st, d.wrote}
	if o.Files != nil {
		d.file, err = o.Files.Add(ctx, dev)
	} else {
		d.file, err = blockdev.MountFile(ctx, filepath.Join(spec.Dir, exposeDir, "fuse"), dev, blockdev.MountOptions{})
	}
	if err != nil {
		return nil, errors.Join(fmt.Errorf("dataplane: %w", err), st.Close())
	}
	if spec.MaxDirty == 0 {
		d.spec.MaxDirty = DefaultMaxDirty
	}
	d.stopSync, d.synced = make(chan struct{}), make(chan struct{})
	go d.flusher(d.spec.MaxDirty, d.stopSync, d.synced)
	return d, nil
}

// Dir is the disk's directory (its name).
func (d *Disk) Dir() string { return d.spec.Dir }

// Path is the device file a loop device or a VMM opens.
func (d *Disk) Path() string { return d.file.Path() }

// Size is the device size in bytes.
func (d *Disk) Size() int64 { return d.st.Size() }

// Lowers returns the stack's current sealed layers, bottom first.
func (d *Disk) Lowers() []stack.LayerRef { return d.st.Manifest().Lowers }

// DropSyncs tells the disk that its directory is deleted once it closes (a killed
// sandbox's): from now on its flushes and its flusher write nothing back (see
// stack.Stack.DropSyncs). Call it only once nothing may rely on the disk's data.
func (d *Disk) DropSyncs() error {
	d.st.DropSyncs()
	return nil
}

// Close stops the flusher, stops serving the device file (whatever attached the file must
// have let go of it: otherwise blockdev.ErrStillInUse is returned, the stack then closing
// when its last user lets go) and closes the stack. The
// upper's files stay in Dir. Idempotent.
func (d *Disk) Close() error {
	d.closeOnce.Do(func() {
		close(d.stopSync)
		<-d.synced
		err := d.file.Close()
		if errors.Is(err, blockdev.ErrStillInUse) {
			// The last user of the device (a filesystem whose mount namespace is still
			// being torn down) keeps being served; the stack closes when it lets go.
			d.log.Warn("dataplane: disk still held after its unmount; it closes when released", "dir", d.spec.Dir)
			go func() {
				<-d.file.Done()
				if err := d.st.Close(); err != nil {
					d.log.Error("dataplane: close a released disk", "dir", d.spec.Dir, "err", err)
				}
				d.log.Info("dataplane: disk released", "dir", d.spec.Dir)
			}()
			d.closeErr = err
			return
		}
		d.closeErr = errors.Join(err, d.st.Close())
	})
	return d.closeErr
}

// flushEvery is how often the flusher looks at the upper's growth while it is written.
const flushEvery = 20 * time.Millisecond

// notifying is the stack as the FUSE file serves it: every write (or discard, which can
// grow the upper's index) wakes the flusher, so an idle disk costs no polling. A data
// plane serving 200 idle disks would otherwise wake 10,000 times a second.
type notifying struct {
	*stack.Stack
	wrote chan<- struct{}
}

func (n notifying) WriteAt(p []byte, off int64) (int, error) {
	k, err := n.Stack.WriteAt(p, off)
	n.wake()
	return k, err
}

func (n notifying) Discard(off, size int64) error {
	err := n.Stack.Discard(off, size)
	n.wake()
	return err
}

func (n notifying) wake() {
	select {
	case n.wrote <- struct{}{}:
	default: // already pending
	}
}

// flusher keeps the upper's data flowing to the host's disk as it is written, until stop
// is closed: it starts writeback (without waiting) whenever the upper has grown by max/2,
// and fsyncs it whenever it has grown by 4*max. The host would write the data back
// anyway, but only after seconds or gigabytes; doing it as it comes keeps what a
// snapshot must make durable (the upper's unsynced tail) small, whatever was written.
// It looks every flushEvery while writes come, and sleeps until the next write once a
// look finds the upper unchanged.
func (d *Disk) flusher(max uint64, stop <-chan struct{}, done chan<- struct{}) {
	defer close(done)
	t := time.NewTicker(flushEvery)
	defer t.Stop()
	synced := UpperBytes(d.spec.Dir)
	kicked, last := synced, synced
	for {
		select {
		case <-stop:
			return
		case <-t.C:
		}
		n := UpperBytes(d.spec.Dir)
		if n < synced || n < kicked {
			// A snapshot restacked: a fresh upper.
			synced, kicked = n, n
		}
		var err error
		switch {
		case uint64(n-synced) >= 4*max:
			d.flushMu.Lock()
			err = d.st.Sync()
			d.flushMu.Unlock()
			synced, kicked = n, n
		case uint64(n-kicked) >= max/2:
			d.flushMu.Lock()
			err = d.st.StartWriteback()
			d.flushMu.Unlock()
			kicked = n
		}
		if err != nil {
			// Closed or broken: the owner sees it on its own path.
			return
		}
		if n != last {
			last = n
			continue
		}
		// Idle: wait for the next write (one during the last tick is pending already).
		t.Stop()
		select {
		case <-stop:
			return
		case <-d.wrote:
		}
		t.Reset(flushEvery)
	}
}

// Snapshot is the stack's part of one live snapshot of a disk, in this order:
// BeginSnapshot (syncs only reach the host's page cache from now on), the caller flushes
// its filesystem (syncfs), Quiet (waits for a flusher fsync in progress: the frozen window
// starts), the caller freezes, Seal (seal the upper into a new lower, open a fresh one),
// the caller thaws, Finish (make the sealed layer durable, compact a deep stack). End
// releases what is held; after a Seal it also does what Finish does, so a snapshot whose
// caller died in the middle still ends durable.
type Snapshot interface {
	Quiet(ctx context.Context) error
	Seal(ctx context.Context, output string) (stack.LayerRef, error)
	// Finish returns every lower of the disk, bottom first, once durable, and how long
	// making them durable took.
	Finish(ctx context.Context) ([]stack.LayerRef, time.Duration, error)
	End()
}

// BeginSnapshot starts a snapshot of d; snapshots of one disk take turns.
func (d *Disk) BeginSnapshot(ctx context.Context) (Snapshot, error) {
	d.snapMu.Lock()
	return &localSnap{d: d, release: d.st.HoldSync()}, nil
}

type localSnap struct {
	d        *Disk
	release  func()
	flushing bool // holds flushMu
	sealed   *stack.LayerRef
	output   string
	finished bool
	ended    bool
}

func (s *localSnap) Quiet(ctx context.Context) error {
	if !s.flushing {
		s.d.flushMu.Lock()
		s.flushing = true
	}
	return nil
}

func (s *localSnap) Seal(ctx context.Context, output string) (stack.LayerRef, error) {
	if s.sealed != nil {
		return stack.LayerRef{}, errors.New("dataplane: snapshot already sealed")
	}
	_ = s.Quiet(ctx)
	ref, err := s.d.st.Restack(ctx, output)
	if err != nil {
		return ref, err
	}
	s.sealed, s.output = &ref, output
	return ref, nil
}

func (s *localSnap) unhold() {
	s.release()
	if s.flushing {
		s.d.flushMu.Unlock()
		s.flushing = false
	}
}

func (s *localSnap) Finish(ctx context.Context) ([]stack.LayerRef, time.Duration, error) {
	s.unhold()
	if s.sealed == nil {
		return nil, 0, errors.New("dataplane: finish of a snapshot that was not sealed")
	}
	if s.finished {
		return s.d.Lowers(), 0, nil
	}
	s.finished = true
	t0 := time.Now()
	if err := s.d.st.Persist(*s.sealed); err != nil {
		return nil, time.Since(t0), err
	}
	durable := time.Since(t0)
	if _, err := s.d.st.CompactIfDeep(ctx, s.output); err != nil {
		// The snapshot is good; the stack just stays deeper than it should.
		s.d.log.Warn("dataplane: compaction after snapshot failed", "dir", s.d.spec.Dir, "err", err)
	}
	// The lowers now end with the sealed upper (or a compaction of the newest lowers,
	// which holds the same data).
	return s.d.Lowers(), durable, nil
}

func (s *localSnap) End() {
	if s.ended {
		return
	}
	s.ended = true
	if s.sealed != nil && !s.finished {
		if _, _, err := s.Finish(context.Background()); err != nil {
			s.d.log.Warn("dataplane: finish an abandoned snapshot", "dir", s.d.spec.Dir, "err", err)
		}
	}
	s.unhold()
	s.d.snapMu.Unlock()
}

// Local opens disks in this process: they die with it.
type Local struct {
	Resolver stack.Resolver
	Logger   *slog.Logger
}

// OpenDisk implements rootfs's disk opener.
func (l Local) OpenDisk(ctx context.Context, spec Spec) (*Disk, error) {
	return OpenDisk(ctx, spec, Options{Resolver: l.Resolver, Log: l.Logger})
}
