package lsmt

import (
	"fmt"
	"io"
)

// Layer is a sealed, read-only LSMT layer: a committed layer or a
// sealed-in-place RW data file. It is safe for concurrent use.
type Layer struct {
	name    string
	r       io.ReaderAt
	size    int64
	header  *Header
	trailer *Header
	index   *Index
	padding int // padding entries skipped while loading
}

// OpenLayer parses the sealed layer held by r (size bytes). name appears in
// errors, e.g. the file path.
func OpenLayer(r io.ReaderAt, size int64, name string) (*Layer, error) {
	if size < 2*HeaderSize {
		return nil, fmt.Errorf("%s: %w: file is %d bytes, a sealed layer needs at least %d",
			name, ErrFormat, size, 2*HeaderSize)
	}
	hb := make([]byte, HeaderSize)
	if _, err := r.ReadAt(hb, 0); err != nil {
		return nil, fmt.Errorf("%s: read header at offset 0: %w", name, err)
	}
	h, err := ParseHeader(hb)
	if err != nil {
		return nil, fmt.Errorf("%s: header at offset 0: %w", name, err)
	}
	if !h.IsHeader() {
		return nil, fmt.Errorf("%s: %w: block at offset 0 is flagged as a trailer (flags %#x)", name, ErrFormat, h.Flags)
	}
	toff := size - HeaderSize
	if _, err := r.ReadAt(hb, toff); err != nil {
		return nil, fmt.Errorf("%s: read trailer at offset %d: %w", name, toff, err)
	}
	t, err := ParseHeader(hb)
	if err != nil {
		return nil, fmt.Errorf("%s: trailer at offset %d: %w (not a sealed layer?)", name, toff, err)
	}
	if t.IsHeader() || !t.IsSealed() {
		return nil, fmt.Errorf("%s: %w: trailer at offset %d has flags %#x, want trailer+sealed",
			name, ErrFormat, toff, t.Flags)
	}
	if t.IndexOffset < HeaderSize || t.IndexOffset > uint64(toff) {
		return nil, fmt.Errorf("%s: %w: trailer index_offset %d outside [%d, %d]", name, ErrFormat,
			t.IndexOffset, HeaderSize, toff)
	}
	if t.IndexSize > (uint64(toff)-t.IndexOffset)/entrySize {
		return nil, fmt.Errorf("%s: %w: trailer index_size %d entries does not fit between offset %d and the trailer at %d",
			name, ErrFormat, t.IndexSize, t.IndexOffset, toff)
	}
	if t.VirtualSize > maxVirtualSize {
		return nil, fmt.Errorf("%s: %w: virtual size %d too large", name, ErrFormat, t.VirtualSize)
	}
	raw := make([]byte, t.IndexSize*entrySize)
	if _, err := r.ReadAt(raw, int64(t.IndexOffset)); err != nil {
		return nil, fmt.Errorf("%s: read index at offset %d: %w", name, t.IndexOffset, err)
	}
	l := &Layer{name: name, r: r, size: size, header: h, trailer: t}
	ms, pad, err := decodeIndex(raw, int64(t.IndexOffset), name, t.IndexOffset/SectorSize, t.VirtualSize)
	if err != nil {
		return nil, err
	}
	l.padding = pad
	if l.index, err = NewIndex(ms); err != nil {
		return nil, fmt.Errorf("%s: index at offset %d: %w", name, t.IndexOffset, err)
	}
	return l, nil
}

// decodeIndex decodes sealed index entries, skipping padding and resetting
// tags, and checks each against the data area [8, dataEnd) sectors and vsize.
func decodeIndex(raw []byte, base int64, name string, dataEnd, vsize uint64) ([]Mapping, int, error) {
	n := len(raw) / entrySize
	ms := make([]Mapping, 0, n)
	pad := 0
	vsect := (vsize + SectorSize - 1) / SectorSize
	for i := 0; i < n; i++ {
		m := DecodeMapping(raw[i*entrySize:])
		if m.IsPadding() {
			pad++
			continue
		}
		m.Tag = 0
		at := base + int64(i*entrySize)
		if !m.Zeroed && (m.MOffset < HeaderSize/SectorSize || m.MEnd() > dataEnd) {
			return nil, 0, fmt.Errorf("%s: %w: index entry %d at offset %d: data sectors [%d, %d) outside [8, %d)",
				name, ErrFormat, i, at, m.MOffset, m.MEnd(), dataEnd)
		}
		if vsize > 0 && m.End() > vsect {
			return nil, 0, fmt.Errorf("%s: %w: index entry %d at offset %d: sectors [%d, %d) beyond virtual size %d",
				name, ErrFormat, i, at, m.Offset, m.End(), vsize)
		}
		if len(ms) > 0 && m.Offset < ms[len(ms)-1].End() {
			return nil, 0, fmt.Errorf("%s: %w: index entry %d at offset %d: sector %d overlaps or precedes the previous entry",
				name, ErrFormat, i, at, m.Offset)
		}
		ms = append(ms, m)
	}
	return ms, pad, nil
}

// Name is the name given at open.
func (l *Layer) Name() string { return l.name }

// Header is the layer's header block.
func (l *Layer) Header() Header { return *l.header }

// Trailer is the layer's trailer block.
func (l *Layer) Trailer() Header { return *l.trailer }

// VirtualSize is the virtual device size in bytes (from the trailer).
func (l *Layer) VirtualSize() uint64 { return l.trailer.VirtualSize }

// UUID is the layer uuid, "" when absent.
func (l *Layer) UUID() string { return l.trailer.UUID }

// Index is the layer's index (tags 0).
func (l *Layer) Index() *Index { return l.index }

// PaddingEntries is the number of padding entries skipped at load.
func (l *Layer) PaddingEntries() int { return l.padding }

// Size is the size of the layer file in bytes.
func (l *Layer) Size() int64 { return l.size }

// ReadPhysical reads data at physical byte offset off of the layer file;
// used by stacks that resolve mappings themselves.
func (l *Layer) ReadPhysical(p []byte, off int64) error {
	return readFull(l.r, p, off, l.name)
}

// ReadAt reads the layer's virtual device on its own (no lowers): holes and
// zeroed mappings read as zeros, reads stop at the virtual size.
func (l *Layer) ReadAt(p []byte, off int64) (int, error) {
	return readVirtual(p, off, l.trailer.VirtualSize, func(q []byte, sect uint64) error {
		return fillFromIndex(q, sect, l.index.Lookup, func(m Mapping, dst []byte) error {
			return l.ReadPhysical(dst, int64(m.MOffset*SectorSize))
		})
	})
}

func readFull(r io.ReaderAt, p []byte, off int64, name string) error {
	n, err := r.ReadAt(p, off)
	if n == len(p) {
		return nil
	}
	if err == nil || err == io.EOF {
		// A short read at the source's end is zero-filled, as C++ does.
		clear(p[n:])
		return nil
	}
	return fmt.Errorf("%s: read %d bytes at offset %d: %w", name, len(p), off, err)
}

// lookupFunc is the shape of Index.Lookup and MutableIndex.Lookup.
type lookupFunc func(off, n uint64, fn func(Mapping) bool)

// fillFromIndex fills q (starting at sector sect) from the mappings that
// lookup reports, zero-filling gaps and zeroed mappings.
func fillFromIndex(q []byte, sect uint64, lookup lookupFunc, read func(Mapping, []byte) error) error {
	n := uint64(len(q)) / SectorSize
	pos := sect
	var err error
	lookup(sect, n, func(m Mapping) bool {
		clear(q[(pos-sect)*SectorSize : (m.Offset-sect)*SectorSize])
		dst := q[(m.Offset-sect)*SectorSize : (m.End()-sect)*SectorSize]
		if m.Zeroed {
			clear(dst)
		} else if err = read(m, dst); err != nil {
			return false
		}
		pos = m.End()
		return true
	})
	if err != nil {
		return err
	}
	clear(q[(pos-sect)*SectorSize:])
	return nil
}

// readVirtual clamps a virtual read to vsize, checks alignment and splits it
// into MaxIOSize pieces.
func readVirtual(p []byte, off int64, vsize uint64, piece func([]byte, uint64) error) (int, error) {
	if off < 0 || off%SectorSize != 0 || len(p)%SectorSize != 0 {
		return 0, fmt.Errorf("read %d bytes at %d: %w", len(p), off, ErrAlignment)
	}
	if uint64(off) >= vsize {
		return 0, io.EOF
	}
	want := len(p)
	if rem := vsize - uint64(off); uint64(want) > rem {
		want = int(rem)
	}
	done := 0
	for done < want {
		k := min(want-done, MaxIOSize)
		if err := piece(p[done:done+k], uint64(off+int64(done))/SectorSize); err != nil {
			return done, err
		}
		done += k
	}
	if done < len(p) {
		return done, io.EOF
	}
	return done, nil
}
