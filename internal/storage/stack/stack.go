// Package stack composes sealed LSMT lowers and one writable upper into a
// virtual block device, with snapshots by seal-and-restack and compaction
// (reference sections 1.11-1.14 and 5.2).
package stack

import (
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"sync"
	"sync/atomic"

	"github.com/aenv-dev/aenv/internal/storage/blob"
	"github.com/aenv-dev/aenv/internal/storage/lsmt"
)

// Sentinel errors.
var (
	// ErrReadOnly marks writes to a stack without an upper.
	ErrReadOnly = errors.New("stack: read-only (no upper layer)")
	// ErrBroken marks a stack whose restack failed after the upper was
	// sealed; it cannot be used any more and must be reopened from its
	// manifest.
	ErrBroken = errors.New("stack: broken by a failed restack")
	// ErrClosed marks use after Close.
	ErrClosed = errors.New("stack: closed")
)

// Source is a sealed layer's bytes, as a Resolver returns them.
type Source interface {
	io.ReaderAt
	Size() int64
	Close() error
}

// Resolver opens lowers that have no local path (e.g. remote blobs by
// digest, behind a block cache).
type Resolver interface {
	OpenLayer(ctx context.Context, ref LayerRef) (Source, error)
}

// Options tune Open.
type Options struct {
	Resolver Resolver // required only for lowers without a path
	// ReadOnly opens the stack without changing any file: an existing upper is
	// opened read-only (writes fail), a missing one is not created.
	ReadOnly bool
	// Lowers, when set, shares the opened lowers (and their merged index) with the
	// other stacks opened with it.
	Lowers *Lowers
}

type lower struct {
	ref LayerRef
	l   *blob.Layer
	src Source
	sh  *sharedLayer // set when the layer is Options.Lowers'
}

// Stack is a virtual block device of N sealed lowers and an optional
// writable upper. All methods are safe for concurrent use; SealAndRestack
// waits for in-flight I/O and blocks new I/O only while it swaps layers.
type Stack struct {
	opts Options

	mu     sync.RWMutex
	m      Manifest
	lowers []*lower    // bottom first
	merged *lsmt.Index // tag 0 = newest lower
	// mergedKey names merged in opts.Lowers when it is shared ("" when it is this
	// stack's own).
	mergedKey string
	byTag     []*lower      // byTag[tag]
	upper     *lsmt.RWLayer // nil when read-only
	vsize     uint64
	broken    error
	closed    bool

	rmw     sync.Mutex // serializes unaligned read-modify-write
	compact sync.Mutex // one compaction at a time
	// syncHeld > 0 makes Sync skip its fsyncs (HoldSync).
	syncHeld atomic.Int32
	// dropped makes Sync and StartWriteback no-ops for good (DropSyncs).
	dropped atomic.Bool
	// sealedIndex is the index file of the upper Restack sealed last, for Persist
	// to remove.
	sealedIndex string
	// unpersisted is the files and directories the last Restack changed until a
	// Persist (or a Sync) made them durable: a Sync between the two must not tell the
	// guest its data is safe while it lies in a sealed layer, or a fresh upper, that a
	// host crash could still lose.
	unpersisted atomic.Pointer[[]string]
	// syncPath fsyncs a file or directory by name (fsyncPath; tests count the calls).
	syncPath func(string) error
}

// Open opens the stack a manifest describes, creating the upper's files when
// they do not exist. m is copied; Manifest returns the live description.
func Open(ctx context.Context, m *Manifest, o Options) (*Stack, error) {
	if err := m.validate(); err != nil {
		return nil, fmt.Errorf("stack: %w", err)
	}
	s := &Stack{opts: o, m: m.clone(), syncPath: fsyncPath}
	ok := false
	defer func() {
		if !ok {
			s.closeLayers()
		}
	}()
	for _, ref := range s.m.Lowers {
		lw, err := s.openLower(ctx, ref)
		if err != nil {
			return nil, err
		}
		s.lowers = append(s.lowers, lw)
	}
	s.rebuild()
	s.vsize = s.m.VirtualSize
	if s.vsize == 0 && len(s.lowers) > 0 {
		s.vsize = s.lowers[len(s.lowers)-1].l.VirtualSize()
	}
	if err := s.openUpper(); err != nil {
		return nil, err
	}
	if s.vsize == 0 && s.upper != nil {
		s.vsize = s.upper.VirtualSize()
	}
	if s.vsize == 0 {
		return nil, fmt.Errorf("stack: virtual size unknown (no manifest size, lowers or upper)")
	}
	s.m.VirtualSize = s.vsize
	ok = true
	return s, nil
}

// openUpper opens the manifest's upper, creating it when missing (a read-only
// stack neither creates it nor cleans up after a crash).
func (s *Stack) openUpper() error {
	u := s.m.Upper
	if u == nil {
		return nil
	}
	d, i := s.m.abs(u.Data), s.m.abs(u.Index)
	if s.opts.ReadOnly {
		up, err := lsmt.OpenRWWith(d, i, lsmt.OpenOptions{ReadOnly: true})
		if err != nil && !errors.Is(err, os.ErrNotExist) {
			return fmt.Errorf("stack upper: %w", err)
		}
		s.upper = up
		return nil
	}
	if !u.Sparse {
		// A crash between Restack and Persist left it; nothing refers to it, so a
		// failure to remove it only costs its space (the next Restack replaces it).
		_ = os.Remove(sealedIndex(i))
	}
	up, err := lsmt.OpenRW(d, i)
	if errors.Is(err, os.ErrNotExist) {
		if _, serr := os.Stat(d); os.IsNotExist(serr) {
			// Not synced here: an empty upper holds nothing anyone was promised, and the
			// layer stays dirty until its first Sync, which makes the headers durable with
			// the first writes (a Sync is what promises anything). Until then a host crash
			// can leave the files empty or missing, which only a disk that was never
			// synced (so never snapshotted or paused) can have.
			up, err = lsmt.CreateRW(d, i, lsmt.CreateOptions{VirtualSize: s.vsize, ParentUUID: s.topUUID(),
				Sparse: u.Sparse, Hybrid: u.Hybrid, NoSync: true})
		}
	}
	if err != nil {
		return fmt.Errorf("stack upper: %w", err)
	}
	s.upper = up
	return nil
}

func (s *Stack) topUUID() string {
	if n := len(s.lowers); n > 0 {
		return s.lowers[n-1].l.UUID()
	}
	return ""
}

func (s *Stack) openLower(ctx context.Context, ref LayerRef) (*lower, error) {
	if s.opts.Lowers == nil {
		l, src, err := s.openLayer(ctx, ref)
		if err != nil {
			return nil, err
		}
		return &lower{ref: ref, l: l, src: src}, nil
	}
	sh, err := s.opts.Lowers.acquire(ctx, s.m.abs(ref.Path), ref.Digest, func(ctx context.Context) (*blob.Layer, Source, error) {
		l, src, err := s.openLayer(ctx, ref)
		if err == nil && l.ZFile != nil && s.opts.Lowers.cache != nil {
			l.ZFile.UseCache(s.opts.Lowers.cache)
		}
		return l, src, err
	})
	if err != nil {
		return nil, err
	}
	return &lower{ref: ref, l: sh.l, src: sh.src, sh: sh}, nil
}

// openLayer opens and parses the layer ref names.
func (s *Stack) openLayer(ctx context.Context, ref LayerRef) (*blob.Layer, Source, error) {
	var src Source
	var err error
	if ref.Path != "" {
		src, err = openFileSource(s.m.abs(ref.Path))
	} else if s.opts.Resolver != nil {
		src, err = s.opts.Resolver.OpenLayer(ctx, ref)
	} else {
		err = fmt.Errorf("stack: lower %s has no path and no resolver is configured", ref.Digest)
	}
	if err != nil {
		return nil, nil, err
	}
	name := ref.Path
	if name == "" {
		name = ref.Digest
	}
	l, err := blob.Open(src, src.Size(), name)
	if err != nil {
		src.Close()
		return nil, nil, fmt.Errorf("stack lower: %w", err)
	}
	return l, src, nil
}

// close lets go of the layer: closes it, or drops this stack's reference to a shared one.
func (lw *lower) close(ls *Lowers) error {
	if lw.sh != nil {
		return ls.release(lw.sh)
	}
	lw.l.Close()
	return lw.src.Close()
}

// rebuild recomputes the merged lower index from scratch (or takes the one shared by
// the stacks with the same lowers); s.mu is held or s is not yet shared.
func (s *Stack) rebuild() {
	idx := make([]*lsmt.Index, len(s.lowers))
	s.byTag = make([]*lower, len(s.lowers))
	ids := make([]uint64, 0, len(s.lowers))
	for i, lw := range s.lowers {
		t := len(s.lowers) - 1 - i
		idx[t] = lw.l.Index()
		s.byTag[t] = lw
		if lw.sh != nil {
			ids = append(ids, lw.sh.id)
		}
	}
	s.dropMerged()
	build := func() *lsmt.Index {
		if len(idx) == 1 {
			// A layer's own index has tag 0 already: merging one would copy it.
			return idx[0]
		}
		return lsmt.Merge(idx)
	}
	if s.opts.Lowers != nil && len(ids) == len(s.lowers) {
		s.merged, s.mergedKey = s.opts.Lowers.acquireMerged(ids, build)
		return
	}
	s.merged = build()
}

// dropMerged lets go of a shared merged index before s.merged is replaced.
func (s *Stack) dropMerged() {
	if s.mergedKey != "" {
		s.opts.Lowers.releaseMerged(s.mergedKey)
		s.mergedKey = ""
	}
}

// Size is the virtual device size in bytes.
func (s *Stack) Size() int64 { return int64(s.vsize) }

// Depth is the number of lowers.
func (s *Stack) Depth() int {
	s.mu.RLock()
	defer s.mu.RUnlock()
	return len(s.lowers)
}

// Manifest returns a copy of the current description (lowers grow with each
// SealAndRestack).
func (s *Stack) Manifest() Manifest {
	s.mu.RLock()
	defer s.mu.RUnlock()
	return s.m.clone()
}

func (s *Stack) usable() error {
	switch {
	case s.closed:
		return ErrClosed
	case s.broken != nil:
		return fmt.Errorf("%w: %v", ErrBroken, s.broken)
	}
	return nil
}

// ReadAt reads the virtual device: upper first, then lowers newest first;
// holes and discarded ranges read as zeros. Any offset and length work.
func (s *Stack) ReadAt(p []byte, off int64) (int, error) {
	s.mu.RLock()
	defer s.mu.RUnlock()
	if err := s.usable(); err != nil {
		return 0, err
	}
	if off < 0 {
		return 0, fmt.Errorf("stack: negative offset %d", off)
	}
	if uint64(off) >= s.vsize {
		return 0, io.EOF
	}
	want := p
	if rem := s.vsize - uint64(off); uint64(len(p)) > rem {
		want = p[:rem]
	}
	if off%lsmt.SectorSize != 0 || len(want)%lsmt.SectorSize != 0 {
		a := off / lsmt.SectorSize * lsmt.SectorSize
		e := (off + int64(len(want)) + lsmt.SectorSize - 1) / lsmt.SectorSize * lsmt.SectorSize
		buf := make([]byte, e-a)
		if err := s.readAligned(buf, a); err != nil {
			return 0, err
		}
		copy(want, buf[off-a:])
	} else if err := s.readAligned(want, off); err != nil {
		return 0, err
	}
	if len(want) < len(p) {
		return len(want), io.EOF
	}
	return len(p), nil
}

// readAligned reads sector-aligned bytes inside the device; s.mu is held.
func (s *Stack) readAligned(p []byte, off int64) error {
	var ums []lsmt.Mapping
	for done := 0; done < len(p); done += lsmt.MaxIOSize {
		q := p[done:min(len(p), done+lsmt.MaxIOSize)]
		sect := uint64(off+int64(done)) / lsmt.SectorSize
		n := uint64(len(q)) / lsmt.SectorSize
		pos := sect
		if s.upper != nil {
			ums = s.upper.Lookup(sect, n, ums[:0])
		}
		for _, m := range ums {
			if err := s.readLowers(q[(pos-sect)*lsmt.SectorSize:(m.Offset-sect)*lsmt.SectorSize], pos); err != nil {
				return err
			}
			dst := q[(m.Offset-sect)*lsmt.SectorSize : (m.End()-sect)*lsmt.SectorSize]
			if m.Zeroed {
				clear(dst)
			} else if err := s.upper.ReadPhysical(dst, int64(m.MOffset*lsmt.SectorSize)); err != nil {
				return err
			}
			pos = m.End()
		}
		if err := s.readLowers(q[(pos-sect)*lsmt.SectorSize:], pos); err != nil {
			return err
		}
	}
	return nil
}

// readLowers fills q, starting at sector sect, from the merged lower index.
func (s *Stack) readLowers(q []byte, sect uint64) error {
	if len(q) == 0 {
		return nil
	}
	pos := sect
	var err error
	s.merged.Lookup(sect, uint64(len(q))/lsmt.SectorSize, func(m lsmt.Mapping) bool {
		clear(q[(pos-sect)*lsmt.SectorSize : (m.Offset-sect)*lsmt.SectorSize])
		dst := q[(m.Offset-sect)*lsmt.SectorSize : (m.End()-sect)*lsmt.SectorSize]
		if m.Zeroed {
			clear(dst)
		} else if err = s.byTag[m.Tag].l.ReadPhysical(dst, int64(m.MOffset*lsmt.SectorSize)); err != nil {
			return false
		}
		pos = m.End()
		return true
	})
	if err != nil {
		return err
	}
	clear(q[(pos-sect)*lsmt.SectorSize:])
	return nil
}

// WriteAt writes p at off into the upper. Unaligned edges are handled by
// read-modify-write of the partial blocks (512 bytes, or 4 KiB for a sparse
// upper, whose index is rebuilt from host filesystem blocks on reopen).
func (s *Stack) WriteAt(p []byte, off int64) (int, error) {
	s.mu.RLock()
	defer s.mu.RUnlock()
	if err := s.writable(); err != nil {
		return 0, err
	}
	if off < 0 || uint64(off)+uint64(len(p)) > s.vsize {
		return 0, fmt.Errorf("stack: write [%d, %d) outside device of %d bytes", off, off+int64(len(p)), s.vsize)
	}
	al := s.writeAlign()
	if off%al == 0 && int64(len(p))%al == 0 {
		return s.upper.WriteAt(p, off)
	}
	s.rmw.Lock()
	defer s.rmw.Unlock()
	a := off / al * al
	e := min((off+int64(len(p))+al-1)/al*al, int64(s.vsize))
	buf := make([]byte, e-a)
	// Only the partial edge blocks need their old contents.
	head := min(al, e-a)
	if err := s.readAligned(buf[:head], a); err != nil {
		return 0, err
	}
	if e-a > al {
		tail := e - (e-1)/al*al
		if err := s.readAligned(buf[int64(len(buf))-tail:], e-tail); err != nil {
			return 0, err
		}
	}
	copy(buf[off-a:], p)
	if _, err := s.upper.WriteAt(buf, a); err != nil {
		return 0, err
	}
	return len(p), nil
}

// writeAlign is the write granularity the upper needs.
func (s *Stack) writeAlign() int64 {
	if s.m.Upper != nil && s.m.Upper.Sparse {
		return 4096
	}
	return lsmt.SectorSize
}

func (s *Stack) writable() error {
	if err := s.usable(); err != nil {
		return err
	}
	if s.upper == nil {
		return ErrReadOnly
	}
	return nil
}

// Discard makes [off, off+n) read as zeros (TRIM). Whole sectors get zeroed
// mappings; partial edge sectors are overwritten with zeros. A sparse upper
// over lowers gets zeros written instead: its punched holes would fall
// through to the lowers once the upper is reopened (upstream format limit).
func (s *Stack) Discard(off, n int64) error {
	if n <= 0 {
		return nil
	}
	s.mu.RLock()
	if err := s.writable(); err != nil {
		s.mu.RUnlock()
		return err
	}
	if off < 0 || uint64(off+n) > s.vsize {
		s.mu.RUnlock()
		return fmt.Errorf("stack: discard [%d, %d) outside device of %d bytes", off, off+n, s.vsize)
	}
	al := s.writeAlign()
	zeroFill := al != lsmt.SectorSize && len(s.lowers) > 0
	a := (off + al - 1) / al * al
	e := (off + n) / al * al
	var err error
	if a < e && !zeroFill {
		err = s.upper.Discard(a, e-a)
	}
	s.mu.RUnlock()
	if err != nil {
		return err
	}
	if a >= e || zeroFill {
		return s.writeZeros(off, n)
	}
	if a > off {
		if err := s.writeZeros(off, a-off); err != nil {
			return err
		}
	}
	if e < off+n {
		return s.writeZeros(e, off+n-e)
	}
	return nil
}

func (s *Stack) writeZeros(off, n int64) error {
	z := make([]byte, min(n, lsmt.MaxIOSize))
	for n > 0 {
		k := min(n, int64(len(z)))
		if _, err := s.WriteAt(z[:k], off); err != nil {
			return err
		}
		off += k
		n -= k
	}
	return nil
}

// Sync makes all completed writes and discards durable (while HoldSync holds, it
// only writes buffered index entries to the page cache). It costs nothing when no
// write or discard completed since the last Sync that returned (see lsmt.RWLayer.Sync):
// the FUSE file gets a flush for every journal commit, close and loop detach of the
// filesystem on it, and about half of them find nothing new.
func (s *Stack) Sync() error {
	if s.dropped.Load() {
		return nil
	}
	s.mu.RLock()
	defer s.mu.RUnlock()
	if err := s.writable(); err != nil {
		return err
	}
	if s.syncHeld.Load() > 0 {
		return s.upper.Flush()
	}
	if p := s.unpersisted.Load(); p != nil {
		// A snapshot's hold ended before its Persist did.
		for _, path := range *p {
			if err := s.syncPath(path); err != nil {
				return fmt.Errorf("stack: sync: %w", err)
			}
		}
		s.unpersisted.CompareAndSwap(p, nil)
	}
	return s.upper.Sync()
}

// StartWriteback starts writing the upper's dirty data back to the host's disk
// without waiting for it, so that a later Sync (or a snapshot's Persist) has little
// left to wait for.
func (s *Stack) StartWriteback() error {
	if s.dropped.Load() {
		return nil
	}
	s.mu.RLock()
	defer s.mu.RUnlock()
	if err := s.writable(); err != nil {
		return err
	}
	return s.upper.StartWriteback()
}

// HoldSync makes Sync skip its fsyncs until release runs: a frozen filesystem's
// flushes then reach the stack (every reader, and a seal, sees them) without waiting
// for the host's disk. The caller makes the data durable itself afterwards (Persist
// after a Restack, or Sync). Holds nest.
func (s *Stack) HoldSync() (release func()) {
	s.syncHeld.Add(1)
	var once sync.Once
	return func() { once.Do(func() { s.syncHeld.Add(-1) }) }
}

// DropSyncs makes every later Sync and StartWriteback return at once without writing
// anything back: for a stack whose upper is deleted once it closes (a killed sandbox's
// disk), where the flushes its filesystem's unmount and its loop device's detach send
// would only fsync files about to be unlinked (five fsyncs of two files per kill, each
// waiting on the host's journal, which under other I/O took seconds). Reads and writes
// go on as before. It cannot be undone: nothing written afterwards is ever promised
// durable.
func (s *Stack) DropSyncs() { s.dropped.Store(true) }

// Synced reports whether every completed write and discard of the upper is durable (a
// stack without an upper has nothing to sync).
func (s *Stack) Synced() bool {
	s.mu.RLock()
	defer s.mu.RUnlock()
	return s.upper == nil || s.upper.Synced()
}

// Close closes every layer; the upper is left unsealed and reopenable.
func (s *Stack) Close() error {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.closed {
		return nil
	}
	s.closed = true
	return s.closeLayers()
}

func (s *Stack) closeLayers() error {
	var err error
	if s.upper != nil {
		err = s.upper.Close()
	}
	s.dropMerged()
	for _, lw := range s.lowers {
		if e := lw.close(s.opts.Lowers); err == nil {
			err = e
		}
	}
	return err
}

type fileSource struct {
	*os.File
	size int64
}

func (f *fileSource) Size() int64 { return f.size }

func openFileSource(path string) (Source, error) {
	f, err := os.Open(path)
	if err != nil {
		return nil, fmt.Errorf("stack lower: %w", err)
	}
	st, err := f.Stat()
	if err != nil {
		f.Close()
		return nil, fmt.Errorf("stack lower: %w", err)
	}
	return &fileSource{File: f, size: st.Size()}, nil
}
