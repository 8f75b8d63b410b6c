package lsmt

import (
	"errors"
	"fmt"
	"io"
	"log/slog"
	"os"
	"slices"
	"sync"
	"sync/atomic"

	"golang.org/x/sys/unix"
)

// groupCommitEntries is how many index entries are buffered before they are
// appended to the index file without an explicit Sync.
const groupCommitEntries = 4096

// RWLayer is a writable LSMT layer: a log-structured data file plus an
// append-only index file, or a single sparse file (reference 1.8, 1.9).
// Writes are durable after Sync. It is safe for concurrent use.
type RWLayer struct {
	name      string
	dataPath  string
	indexPath string // "" for sparse layers
	data      *os.File
	idx       *os.File

	mu      sync.RWMutex
	header  *Header
	index   *MutableIndex
	eof     int64 // next append position in the data file (512-aligned)
	idxEOF  int64
	pending []byte // buffered index entries not yet in the index file
	closed  bool
	// readOnly layers refuse every change, to either file.
	readOnly bool
	// torn lists the index entries (by number) whose data never reached the data file.
	torn []int

	// A guest's filesystem flushes its device far more often than it writes to it
	// (journal commits, unmounts, loop detaches, closes of the device file): about half
	// of those Syncs would fsync files that no write touched since the previous fsync.
	// Such a Sync may return at once, but only when that is provably true, so gen counts
	// every change to the files (bumped when a WriteAt or Discard returns, after its data
	// and index entry are written or queued) and syncedGen is the gen a successful Sync
	// read before it flushed the queued entries and fsynced: every write that had
	// returned by then is durable. A write that returns during a Sync bumps gen past what
	// that Sync records, so the next Sync fsyncs again. A freshly opened layer starts
	// dirty: what a previous process wrote may be only in the page cache.
	gen, syncedGen atomic.Uint64
	// syncFile fsyncs one of the layer's files (tests count the calls).
	syncFile func(*os.File) error
}

// CreateOptions describe a new writable layer.
type CreateOptions struct {
	VirtualSize uint64 // bytes; must be a multiple of 512
	UUID        string // generated when empty
	ParentUUID  string
	UserTag     string
	Sparse      bool // one sparse file, no index file
	// Hybrid overwrites data the layer already holds in place instead of
	// appending it (AgentENV's hybridLogStructured upper, flag bit 5): the
	// data file stops growing under rewrites, at the price of torn blocks on
	// a host crash between syncs.
	Hybrid bool
	// NoSync leaves the new files unsynced (the caller calls Sync before relying on
	// them): creating a layer then costs no disk flush, e.g. inside a snapshot's
	// frozen window.
	NoSync bool
}

// CreateRW creates a new writable layer. indexPath is ignored for sparse
// layers. Existing files are not overwritten.
func CreateRW(dataPath, indexPath string, o CreateOptions) (*RWLayer, error) {
	if o.VirtualSize%SectorSize != 0 || o.VirtualSize > maxVirtualSize {
		return nil, fmt.Errorf("create %s: virtual size %d: %w", dataPath, o.VirtualSize, ErrAlignment)
	}
	if o.UUID == "" {
		o.UUID = NewUUID()
	}
	h := &Header{Flags: FlagHeader | FlagData, VirtualSize: o.VirtualSize, UUID: o.UUID,
		ParentUUID: o.ParentUUID, UserTag: o.UserTag, Version: 1, SubVersion: 1}
	if o.Sparse && o.Hybrid {
		return nil, fmt.Errorf("create %s: sparse and hybrid are exclusive", dataPath)
	}
	if o.Sparse {
		h.Flags |= FlagSparseRW
		indexPath = ""
	}
	if o.Hybrid {
		h.Flags |= FlagHybridRW
	}
	hb, err := h.MarshalBinary()
	if err != nil {
		return nil, fmt.Errorf("create %s: %w", dataPath, err)
	}
	data, err := os.OpenFile(dataPath, os.O_RDWR|os.O_CREATE|os.O_EXCL, 0o644)
	if err != nil {
		return nil, fmt.Errorf("create layer: %w", err)
	}
	l := &RWLayer{name: dataPath, dataPath: dataPath, indexPath: indexPath, data: data, header: h,
		index: NewMutableIndex(), eof: HeaderSize, idxEOF: HeaderSize, syncFile: (*os.File).Sync}
	l.gen.Store(1) // the headers are not durable yet
	fail := func(err error) (*RWLayer, error) {
		data.Close()
		os.Remove(dataPath)
		if l.idx != nil {
			l.idx.Close()
			os.Remove(indexPath)
		}
		return nil, fmt.Errorf("create %s: %w", dataPath, err)
	}
	if _, err := data.WriteAt(hb, 0); err != nil {
		return fail(err)
	}
	if o.Sparse {
		l.eof = HeaderSize + int64(o.VirtualSize)
		if err := data.Truncate(l.eof); err != nil {
			return fail(err)
		}
	} else {
		ih := *h
		ih.Flags = FlagHeader
		ih.IndexOffset = HeaderSize
		ib, _ := ih.MarshalBinary()
		if l.idx, err = os.OpenFile(indexPath, os.O_RDWR|os.O_CREATE|os.O_EXCL, 0o644); err != nil {
			return fail(err)
		}
		if _, err := l.idx.WriteAt(ib, 0); err != nil {
			return fail(err)
		}
	}
	if !o.NoSync {
		if err := l.syncFiles(); err != nil {
			return fail(err)
		}
		l.syncedGen.Store(1)
	}
	return l, nil
}

// OpenOptions tune OpenRWWith.
type OpenOptions struct {
	// ReadOnly opens the layer without changing either file: torn index
	// entries are skipped in memory only, and writes, discards and syncs fail
	// with ErrReadOnly. Inspection and read-only tools use it.
	ReadOnly bool
}

// OpenRW opens an existing writable layer for writing; see OpenRWWith.
func OpenRW(dataPath, indexPath string) (*RWLayer, error) {
	return OpenRWWith(dataPath, indexPath, OpenOptions{})
}

// OpenRWWith opens an existing writable layer, replaying its index file in
// order (or rebuilding a sparse layer's index from the file's extents).
//
// An index entry whose data lies (partly) past the end of the data file is
// torn: a host crash persisted the entry but not the data appended before it.
// Only such entries are dropped, never the entries after them: writes that no
// flush separated may reach a disk in any order, so losing exactly the torn
// ones is a state a crashed disk can be in, and their data is not there to
// keep. A writable open overwrites each torn entry in place with a padding
// entry (readers, upstream's included, skip those) and syncs the index before
// returning, so later appends can never be read through a stale entry; it
// logs every dropped entry at error level. Anything else wrong with an entry
// (inside the header, beyond the virtual size) refuses the layer, changing
// nothing, as upstream does.
func OpenRWWith(dataPath, indexPath string, o OpenOptions) (*RWLayer, error) {
	flag := os.O_RDWR
	if o.ReadOnly {
		flag = os.O_RDONLY
	}
	data, err := os.OpenFile(dataPath, flag, 0)
	if err != nil {
		return nil, fmt.Errorf("open layer: %w", err)
	}
	l, err := openRW(data, dataPath, indexPath, o.ReadOnly)
	if err != nil {
		data.Close()
		if l != nil && l.idx != nil {
			l.idx.Close()
		}
		return nil, err
	}
	return l, nil
}

func openRW(data *os.File, dataPath, indexPath string, readOnly bool) (*RWLayer, error) {
	st, err := data.Stat()
	if err != nil {
		return nil, fmt.Errorf("open %s: %w", dataPath, err)
	}
	hb := make([]byte, HeaderSize)
	if _, err := data.ReadAt(hb, 0); err != nil {
		return nil, fmt.Errorf("%s: read header at offset 0: %w", dataPath, err)
	}
	h, err := ParseHeader(hb)
	if err != nil {
		return nil, fmt.Errorf("%s: header at offset 0: %w", dataPath, err)
	}
	if !h.IsHeader() || h.Flags&FlagData == 0 || h.IsSealed() || h.IsSparse() && h.Flags&FlagHybridRW != 0 {
		return nil, fmt.Errorf("%s: %w: header flags %#x are not a writable data file", dataPath, ErrFormat, h.Flags)
	}
	if st.Size() >= 2*HeaderSize {
		if _, err := data.ReadAt(hb, st.Size()-HeaderSize); err == nil {
			if t, err := ParseHeader(hb); err == nil && !t.IsHeader() && t.IsSealed() {
				return nil, fmt.Errorf("%s: %w: has a sealed trailer", dataPath, ErrSealed)
			}
		}
	}
	l := &RWLayer{name: dataPath, dataPath: dataPath, data: data, header: h, index: NewMutableIndex(), readOnly: readOnly,
		syncFile: (*os.File).Sync}
	l.gen.Store(1) // a crashed writer's last writes may be only in the page cache
	if h.IsSparse() {
		return l, l.rebuildSparse(st.Size())
	}
	l.indexPath = indexPath
	l.eof = (st.Size() + SectorSize - 1) / SectorSize * SectorSize
	flag := os.O_RDWR
	if readOnly {
		flag = os.O_RDONLY
	}
	if l.idx, err = os.OpenFile(indexPath, flag, 0); err != nil {
		return l, fmt.Errorf("open index: %w", err)
	}
	if err := l.replay(uint64(st.Size())); err != nil {
		return l, err
	}
	return l, l.dropTorn()
}

// dropPartialEntry truncates a partial last index entry (one append of whole
// entries cut short by a crash: provably torn) on a writable open.
func (l *RWLayer) dropPartialEntry(size int64) error {
	if l.readOnly || size == l.idxEOF {
		return nil
	}
	slog.Error("lsmt: dropped a partial index entry left by a crash", "index", l.indexPath,
		"offset", l.idxEOF, "bytes", size-l.idxEOF)
	if err := l.idx.Truncate(l.idxEOF); err != nil {
		return fmt.Errorf("%s: drop partial entry: %w", l.indexPath, err)
	}
	return nil
}

func (l *RWLayer) replay(dataSize uint64) error {
	raw, err := io.ReadAll(l.idx)
	if err != nil {
		return fmt.Errorf("%s: read index: %w", l.indexPath, err)
	}
	if len(raw) < HeaderSize {
		return fmt.Errorf("%s: %w: index file is %d bytes, shorter than its header", l.indexPath, ErrFormat, len(raw))
	}
	ih, err := ParseHeader(raw)
	if err != nil {
		return fmt.Errorf("%s: header at offset 0: %w", l.indexPath, err)
	}
	if ih.Flags&FlagData != 0 || ih.IsSealed() || ih.IndexOffset != HeaderSize {
		return fmt.Errorf("%s: %w: index header flags %#x index_offset %d", l.indexPath, ErrFormat, ih.Flags, ih.IndexOffset)
	}
	entries := raw[HeaderSize:]
	n := len(entries) / entrySize
	l.idxEOF = HeaderSize + int64(n*entrySize)
	dataEnd := dataSize / SectorSize
	for i := 0; i < n; i++ {
		m := DecodeMapping(entries[i*entrySize:])
		if m.IsPadding() {
			continue
		}
		m.Tag = 0
		if vs := l.header.VirtualSize; vs > 0 && m.End() > (vs+SectorSize-1)/SectorSize {
			return fmt.Errorf("%s: %w: index entry %d at offset %d: sectors [%d, %d) beyond virtual size %d",
				l.indexPath, ErrFormat, i, HeaderSize+i*entrySize, m.Offset, m.End(), vs)
		}
		if !m.Zeroed && m.MOffset < HeaderSize/SectorSize {
			return fmt.Errorf("%s: %w: index entry %d at offset %d: data sector %d lies inside the header",
				l.indexPath, ErrFormat, i, HeaderSize+i*entrySize, m.MOffset)
		}
		if !m.Zeroed && m.MEnd() > dataEnd {
			l.torn = append(l.torn, i)
			continue
		}
		l.index.Insert(m)
	}
	return l.dropPartialEntry(int64(len(raw)))
}

// dropTorn reports the torn entries replay skipped and, on a writable open,
// overwrites them with padding entries and syncs the index.
func (l *RWLayer) dropTorn() error {
	if len(l.torn) == 0 {
		return nil
	}
	if l.readOnly {
		slog.Warn("lsmt: layer has torn index entries (data never written); ignoring them, layer left unchanged",
			"index", l.indexPath, "entries", len(l.torn), "first", l.torn[0])
		return nil
	}
	for _, i := range l.torn {
		if _, err := l.idx.WriteAt(invalidEntry[:], HeaderSize+int64(i*entrySize)); err != nil {
			return fmt.Errorf("%s: drop torn entry %d: %w", l.indexPath, i, err)
		}
		slog.Error("lsmt: dropped a torn index entry: its data never reached the data file, so that write is lost",
			"index", l.indexPath, "entry", i, "offset", HeaderSize+i*entrySize)
	}
	if err := l.idx.Sync(); err != nil {
		return fmt.Errorf("%s: fsync after dropping torn entries: %w", l.indexPath, err)
	}
	return nil
}

// TornEntries lists, by number, the index entries that were dropped (or, read
// only, skipped) at open because their data never reached the data file.
func (l *RWLayer) TornEntries() []int { return slices.Clone(l.torn) }

func (l *RWLayer) rebuildSparse(size int64) error {
	fd := int(l.data.Fd())
	l.eof = HeaderSize + int64(l.header.VirtualSize)
	pos := int64(HeaderSize)
	for pos < size {
		b, err := unix.Seek(fd, pos, unix.SEEK_DATA)
		if err != nil {
			if errors.Is(err, unix.ENXIO) {
				break
			}
			return fmt.Errorf("%s: seek data at %d: %w", l.name, pos, err)
		}
		e, err := unix.Seek(fd, b, unix.SEEK_HOLE)
		if err != nil {
			return fmt.Errorf("%s: seek hole at %d: %w", l.name, b, err)
		}
		e = min(e, l.eof)
		b = b / SectorSize * SectorSize
		for s := b; s < e; {
			n := min((e-s+SectorSize-1)/SectorSize, MaxLength)
			l.index.Insert(Mapping{Offset: uint64(s-HeaderSize) / SectorSize, Length: uint32(n), MOffset: uint64(s) / SectorSize})
			s += n * SectorSize
		}
		pos = e
		if pos >= l.eof {
			break
		}
	}
	return nil
}

// Name is the data file path.
func (l *RWLayer) Name() string { return l.name }

// Header returns the data file header.
func (l *RWLayer) Header() Header {
	l.mu.RLock()
	defer l.mu.RUnlock()
	return *l.header
}

// VirtualSize is the virtual device size in bytes.
func (l *RWLayer) VirtualSize() uint64 { return l.Header().VirtualSize }

// Mappings returns a copy of the layer's own index.
func (l *RWLayer) Mappings() []Mapping {
	l.mu.RLock()
	defer l.mu.RUnlock()
	return l.index.Snapshot()
}

// Lookup collects the mappings intersecting sectors [off, off+n), clipped,
// appending them to buf. Physical data behind a returned mapping is never
// rewritten by a log-structured layer, so callers may read it after Lookup
// returns (a hybrid layer may rewrite it in place, like a disk would).
func (l *RWLayer) Lookup(off, n uint64, buf []Mapping) []Mapping {
	l.mu.RLock()
	defer l.mu.RUnlock()
	l.index.Lookup(off, n, func(m Mapping) bool {
		buf = append(buf, m)
		return true
	})
	return buf
}

// ReadPhysical reads the data file at byte offset off.
func (l *RWLayer) ReadPhysical(p []byte, off int64) error {
	return readFull(l.data, p, off, l.name)
}

// ReadAt reads the layer's own virtual device (no lowers).
func (l *RWLayer) ReadAt(p []byte, off int64) (int, error) {
	if err := l.checkOpen(); err != nil {
		return 0, err
	}
	return readVirtual(p, off, l.VirtualSize(), func(q []byte, sect uint64) error {
		ms := l.Lookup(sect, uint64(len(q))/SectorSize, nil)
		return fillFromIndex(q, sect, func(_, _ uint64, fn func(Mapping) bool) {
			for _, m := range ms {
				if !fn(m) {
					return
				}
			}
		}, func(m Mapping, dst []byte) error { return l.ReadPhysical(dst, int64(m.MOffset*SectorSize)) })
	})
}

func (l *RWLayer) checkOpen() error {
	l.mu.RLock()
	defer l.mu.RUnlock()
	if l.closed {
		return fmt.Errorf("%s: %w", l.name, ErrClosed)
	}
	return nil
}

// WriteAt writes p at virtual offset off; both must be 512-aligned.
func (l *RWLayer) WriteAt(p []byte, off int64) (int, error) {
	if l.readOnly {
		return 0, fmt.Errorf("%s: %w", l.name, ErrReadOnly)
	}
	if off < 0 || off%SectorSize != 0 || len(p)%SectorSize != 0 {
		return 0, fmt.Errorf("%s: write %d bytes at %d: %w", l.name, len(p), off, ErrAlignment)
	}
	if vs := l.VirtualSize(); uint64(off)+uint64(len(p)) > vs {
		return 0, fmt.Errorf("%s: write [%d, %d) beyond virtual size %d: %w", l.name, off, off+int64(len(p)), vs, io.ErrShortWrite)
	}
	// Even a failed write may have changed the data file (a hybrid overwrite in place).
	defer l.gen.Add(1)
	done := 0
	for done < len(p) {
		k := min(len(p)-done, MaxIOSize)
		if err := l.writePiece(p[done:done+k], off+int64(done)); err != nil {
			return done, err
		}
		done += k
	}
	return done, nil
}

func (l *RWLayer) writePiece(p []byte, off int64) error {
	if l.header.Flags&FlagHybridRW != 0 {
		return l.writeHybrid(p, off)
	}
	return l.appendPiece(p, off)
}

func (l *RWLayer) appendPiece(p []byte, off int64) error {
	sparse := l.indexPath == ""
	var phys int64
	l.mu.Lock()
	if l.closed {
		l.mu.Unlock()
		return fmt.Errorf("%s: %w", l.name, ErrClosed)
	}
	if sparse {
		phys = HeaderSize + off
	} else {
		phys = l.eof
		l.eof += int64(len(p))
	}
	l.mu.Unlock()
	if _, err := l.data.WriteAt(p, phys); err != nil {
		return fmt.Errorf("%s: write data at %d: %w", l.name, phys, err)
	}
	return l.record(Mapping{Offset: uint64(off) / SectorSize, Length: uint32(len(p) / SectorSize), MOffset: uint64(phys) / SectorSize})
}

// writeHybrid overwrites the parts of p the layer already backs with data
// in place (no new index entry) and appends the rest.
func (l *RWLayer) writeHybrid(p []byte, off int64) error {
	sect := uint64(off) / SectorSize
	n := uint64(len(p)) / SectorSize
	pos := sect
	for _, m := range l.Lookup(sect, n, nil) {
		if m.Offset > pos {
			if err := l.appendPiece(p[(pos-sect)*SectorSize:(m.Offset-sect)*SectorSize], int64(pos*SectorSize)); err != nil {
				return err
			}
		}
		chunk := p[(m.Offset-sect)*SectorSize : (m.End()-sect)*SectorSize]
		if m.Zeroed {
			if err := l.appendPiece(chunk, int64(m.Offset*SectorSize)); err != nil {
				return err
			}
		} else if _, err := l.data.WriteAt(chunk, int64(m.MOffset*SectorSize)); err != nil {
			return fmt.Errorf("%s: overwrite data at %d: %w", l.name, m.MOffset*SectorSize, err)
		}
		pos = m.End()
	}
	if pos < sect+n {
		return l.appendPiece(p[(pos-sect)*SectorSize:], int64(pos*SectorSize))
	}
	return nil
}

// record inserts m and queues its index entry, in one critical section so
// the index file replays in the order the in-memory index saw.
func (l *RWLayer) record(m Mapping) error {
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.closed {
		return fmt.Errorf("%s: %w", l.name, ErrClosed)
	}
	l.index.Insert(m)
	if l.indexPath == "" {
		return nil
	}
	var e [entrySize]byte
	EncodeMapping(e[:], m)
	l.pending = append(l.pending, e[:]...)
	if len(l.pending) >= groupCommitEntries*entrySize {
		return l.flushLocked()
	}
	return nil
}

func (l *RWLayer) flushLocked() error {
	if len(l.pending) == 0 {
		return nil
	}
	if _, err := l.idx.WriteAt(l.pending, l.idxEOF); err != nil {
		return fmt.Errorf("%s: append index at %d: %w", l.indexPath, l.idxEOF, err)
	}
	l.idxEOF += int64(len(l.pending))
	l.pending = l.pending[:0]
	return nil
}

// Discard makes [off, off+n) read as zeros without writing data: it appends
// zeroed mappings (log-structured) or punches a hole (sparse).
func (l *RWLayer) Discard(off, n int64) error {
	if l.readOnly {
		return fmt.Errorf("%s: %w", l.name, ErrReadOnly)
	}
	if off < 0 || n < 0 || off%SectorSize != 0 || n%SectorSize != 0 {
		return fmt.Errorf("%s: discard %d bytes at %d: %w", l.name, n, off, ErrAlignment)
	}
	if vs := l.VirtualSize(); uint64(off+n) > vs {
		return fmt.Errorf("%s: discard [%d, %d) beyond virtual size %d: %w", l.name, off, off+n, vs, io.ErrShortWrite)
	}
	defer l.gen.Add(1)
	sparse := l.indexPath == ""
	if sparse {
		if err := unix.Fallocate(int(l.data.Fd()), unix.FALLOC_FL_PUNCH_HOLE|unix.FALLOC_FL_KEEP_SIZE, HeaderSize+off, n); err != nil {
			return fmt.Errorf("%s: punch hole at %d: %w", l.name, HeaderSize+off, err)
		}
	}
	for s := uint64(off) / SectorSize; n > 0; {
		k := min(uint64(n)/SectorSize, MaxLength)
		l.mu.RLock()
		mo := uint64(l.eof) / SectorSize
		l.mu.RUnlock()
		if sparse {
			mo = (HeaderSize + s*SectorSize) / SectorSize
		}
		if err := l.record(Mapping{Offset: s, Length: uint32(k), MOffset: mo, Zeroed: true}); err != nil {
			return err
		}
		s += k
		n -= int64(k * SectorSize)
	}
	return nil
}

// Sync makes every completed write and discard durable.
func (l *RWLayer) Sync() error {
	if l.readOnly {
		return fmt.Errorf("%s: %w", l.name, ErrReadOnly)
	}
	l.mu.Lock()
	if l.closed {
		l.mu.Unlock()
		return fmt.Errorf("%s: %w", l.name, ErrClosed)
	}
	// Read under mu, before the flush: every write that returned before this point
	// queued its index entry before bumping gen, so the flush below writes it.
	g := l.gen.Load()
	if g == l.syncedGen.Load() {
		l.mu.Unlock()
		return nil
	}
	err := l.flushLocked()
	l.mu.Unlock()
	if err != nil {
		return err
	}
	if err := l.syncFiles(); err != nil {
		return err
	}
	// Concurrent Syncs finish in any order: keep the newest gen one of them covered.
	for {
		s := l.syncedGen.Load()
		if s >= g || l.syncedGen.CompareAndSwap(s, g) {
			return nil
		}
	}
}

// Synced reports whether every write and discard that completed is durable (the last
// Sync covered them).
func (l *RWLayer) Synced() bool { return l.gen.Load() == l.syncedGen.Load() }

// Flush writes buffered index entries to the index file without syncing it: a
// reopen after the process (not the host) dies sees every completed write.
func (l *RWLayer) Flush() error {
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.closed {
		return fmt.Errorf("%s: %w", l.name, ErrClosed)
	}
	return l.flushLocked()
}

// StartWriteback starts writing the data file's dirty pages back to disk without
// waiting for them (sync_file_range): a later Sync then finds little left to write.
func (l *RWLayer) StartWriteback() error {
	l.mu.RLock()
	defer l.mu.RUnlock()
	if l.closed {
		return fmt.Errorf("%s: %w", l.name, ErrClosed)
	}
	if err := unix.SyncFileRange(int(l.data.Fd()), 0, 0, unix.SYNC_FILE_RANGE_WRITE); err != nil {
		return fmt.Errorf("%s: start writeback: %w", l.name, err)
	}
	return nil
}

func (l *RWLayer) syncFiles() error {
	if err := l.syncFile(l.data); err != nil {
		return fmt.Errorf("%s: fsync: %w", l.name, err)
	}
	if l.idx != nil {
		if err := l.syncFile(l.idx); err != nil {
			return fmt.Errorf("%s: fsync: %w", l.indexPath, err)
		}
	}
	return nil
}

// ReadOnly reports whether the layer was opened read-only.
func (l *RWLayer) ReadOnly() bool { return l.readOnly }

// Close flushes buffered index entries and closes the files without
// sealing; the layer can be reopened with OpenRW.
func (l *RWLayer) Close() error {
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.closed {
		return nil
	}
	l.closed = true
	err := l.flushLocked()
	if e := l.data.Close(); err == nil {
		err = e
	}
	if l.idx != nil {
		if e := l.idx.Close(); err == nil {
			err = e
		}
	}
	return err
}
