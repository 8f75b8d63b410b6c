package lsmt

import (
	"encoding/binary"
	"fmt"
)

// Field limits of the 16-byte on-disk mapping (reference 1.5).
const (
	offsetBits     = 50
	lengthBits     = 14
	moffsetBits    = 55
	InvalidOffset  = 1<<offsetBits - 1
	maxMOffset     = 1<<moffsetBits - 1
	maxVirtualSize = InvalidOffset * SectorSize
)

// Mapping maps Length sectors at logical sector Offset to physical sector
// MOffset of layer Tag. A Zeroed mapping reads as zeros and has no data.
type Mapping struct {
	Offset  uint64
	MOffset uint64
	Length  uint32
	Zeroed  bool
	Tag     uint8
}

// End is the first logical sector after m.
func (m Mapping) End() uint64 { return m.Offset + uint64(m.Length) }

// MEnd is the first physical sector after m's data (MOffset when zeroed).
func (m Mapping) MEnd() uint64 {
	if m.Zeroed {
		return m.MOffset
	}
	return m.MOffset + uint64(m.Length)
}

// forwardTo drops the part of m before sector x (x inside m).
func (m Mapping) forwardTo(x uint64) Mapping {
	d := x - m.Offset
	m.Offset = x
	m.Length -= uint32(d)
	if !m.Zeroed {
		m.MOffset += d
	}
	return m
}

// backwardTo drops the part of m from sector x on (x inside m).
func (m Mapping) backwardTo(x uint64) Mapping {
	m.Length = uint32(x - m.Offset)
	return m
}

// clip returns m restricted to [lo, hi); m must intersect the range.
// It uses min and max rather than branches: whether a lookup starts inside
// a mapping is random, so branches here mispredict about half the time.
func (m *Mapping) clip(lo, hi uint64) Mapping {
	var c Mapping
	m.clipTo(&c, lo, hi)
	return c
}

// clipTo stores m restricted to [lo, hi) in c, one field at a time: the
// compiler copies a whole Mapping as two overlapping 16-byte moves, and
// reading a field back from such a copy stalls on store forwarding (perf
// put half of a lookup's time there).
func (m *Mapping) clipTo(c *Mapping, lo, hi uint64) {
	off, end, mo, z := m.Offset, m.End(), m.MOffset, m.Zeroed
	s, e := max(off, lo), min(end, hi)
	// Zeroed mappings keep their MOffset: the shift is masked to 0.
	c.Offset = s
	c.MOffset = mo + (s-off)&(uint64(b2u(z))-1)
	c.Length = uint32(e - s)
	c.Zeroed = z
	c.Tag = m.Tag
}

func b2u(b bool) uint8 {
	if b {
		return 1
	}
	return 0
}

// EncodeMapping writes m in the 16-byte on-disk form.
func EncodeMapping(b []byte, m Mapping) {
	low := m.Offset&InvalidOffset | uint64(m.Length)<<offsetBits
	high := m.MOffset & maxMOffset
	if m.Zeroed {
		high |= 1 << moffsetBits
	}
	high |= uint64(m.Tag) << 56
	binary.LittleEndian.PutUint64(b[0:], low)
	binary.LittleEndian.PutUint64(b[8:], high)
}

// DecodeMapping reads a 16-byte on-disk mapping, tag included.
func DecodeMapping(b []byte) Mapping {
	low := binary.LittleEndian.Uint64(b[0:])
	high := binary.LittleEndian.Uint64(b[8:])
	return Mapping{
		Offset:  low & InvalidOffset,
		Length:  uint32(low >> offsetBits),
		MOffset: high & maxMOffset,
		Zeroed:  high>>moffsetBits&1 == 1,
		Tag:     uint8(high >> 56),
	}
}

// IsPadding reports entries readers skip: the invalid offset (C++) or a zero
// length (AgentENV).
func (m Mapping) IsPadding() bool { return m.Offset == InvalidOffset || m.Length == 0 }

var invalidEntry = func() [entrySize]byte {
	var b [entrySize]byte
	EncodeMapping(b[:], Mapping{Offset: InvalidOffset})
	return b
}()

// Index is an immutable, sorted, non-overlapping list of mappings, the form
// of a sealed layer's index and of a merged stack of lowers.
type Index struct {
	m []Mapping
	// bt is a static B+tree over the mapping ends, built once here: lookups
	// run many times per read on indexes of up to millions of mappings.
	bt stree
}

func newIndex(ms []Mapping) *Index {
	return &Index{m: ms, bt: newStree(ms)}
}

// NewIndex checks that ms is sorted and non-overlapping and wraps it.
func NewIndex(ms []Mapping) (*Index, error) {
	for i := range ms {
		if ms[i].Length == 0 {
			return nil, fmt.Errorf("%w: entry %d has zero length", ErrFormat, i)
		}
		if i > 0 && ms[i].Offset < ms[i-1].End() {
			return nil, fmt.Errorf("%w: entry %d (sector %d) overlaps or precedes entry %d (end %d)",
				ErrFormat, i, ms[i].Offset, i-1, ms[i-1].End())
		}
	}
	return newIndex(ms), nil
}

// Len is the number of mappings.
func (ix *Index) Len() int { return len(ix.m) }

// Mappings returns the mappings; callers must not modify them.
func (ix *Index) Mappings() []Mapping { return ix.m }

// first returns the position of the first mapping ending after sector off.
func (ix *Index) first(off uint64) int { return ix.bt.search(off) }

// Lookup calls fn for every mapping intersecting sectors [off, off+n),
// clipped to that range, in ascending order; gaps are not reported.
// It stops early when fn returns false.
func (ix *Index) Lookup(off, n uint64, fn func(Mapping) bool) {
	end := off + n
	// The common case calls the vector descent directly (search32 inlines,
	// first cannot): one call per lookup instead of two.
	i := 0
	if t := &ix.bt; t.vec32 && off < t.maxEnd {
		i = t.search32(off)
	} else {
		i = t.search(off)
	}
	for ; i < len(ix.m); i++ {
		p := &ix.m[i]
		if p.Offset >= end {
			return
		}
		if !fn(p.clip(off, end)) {
			return
		}
	}
}

// AppendLookup appends the mappings intersecting sectors [off, off+n),
// clipped to that range, in ascending order, to dst and returns the result:
// Lookup without a callback, as upstream's lookup(segment, pm, n).
func (ix *Index) AppendLookup(dst []Mapping, off, n uint64) []Mapping {
	end := off + n
	i := 0 // as in Lookup
	if t := &ix.bt; t.vec32 && off < t.maxEnd {
		i = t.search32(off)
	} else {
		i = t.search(off)
	}
	for ; i < len(ix.m); i++ {
		p := &ix.m[i]
		if p.Offset >= end {
			break
		}
		if len(dst) == cap(dst) {
			dst = append(dst, Mapping{})
		} else {
			dst = dst[:len(dst)+1]
		}
		p.clipTo(&dst[len(dst)-1], off, end)
	}
	return dst
}

// Overlay returns the mappings of top over bottom: every top mapping plus the
// parts of bottom mappings that top does not cover. Both inputs must be sorted
// and non-overlapping; the result is too. It runs in linear time.
func Overlay(top, bottom []Mapping) []Mapping {
	out := make([]Mapping, 0, len(top)+len(bottom))
	j := 0
	var cur Mapping
	have := false
	next := func() bool {
		if have {
			return true
		}
		if j < len(bottom) {
			cur, have = bottom[j], true
			j++
		}
		return have
	}
	for _, t := range top {
		for next() && cur.Offset < t.Offset {
			if cur.End() <= t.Offset {
				out = append(out, cur)
				have = false
				continue
			}
			out = append(out, cur.backwardTo(t.Offset))
			cur = cur.forwardTo(t.Offset)
		}
		out = append(out, t)
		for next() && cur.Offset < t.End() {
			if cur.End() <= t.End() {
				have = false
				continue
			}
			cur = cur.forwardTo(t.End())
		}
	}
	for next() {
		out = append(out, cur)
		have = false
	}
	return out
}

// Merge builds the merged index of a stack of sealed layers given top
// (newest) first, as upstream merge_memory_indexes: each mapping's tag is its
// layer's position in that list, so tag 0 is the newest layer.
func Merge(layers []*Index) *Index {
	var acc []Mapping
	for i := len(layers) - 1; i >= 0; i-- {
		top := make([]Mapping, len(layers[i].m))
		for k, m := range layers[i].m {
			m.Tag = uint8(i)
			top[k] = m
		}
		acc = Overlay(top, acc)
	}
	return newIndex(acc)
}

// Compress merges adjacent mappings that continue each other physically, as
// upstream compress_raw_index does (strict "< MaxLength" rule, as C++).
func Compress(ms []Mapping) []Mapping {
	if len(ms) == 0 {
		return ms
	}
	out := ms[:1:1]
	out = append([]Mapping(nil), out...)
	for _, m := range ms[1:] {
		p := &out[len(out)-1]
		if p.End() == m.Offset && p.MEnd() == m.MOffset && p.Zeroed == m.Zeroed && p.Tag == m.Tag &&
			p.Length+m.Length < MaxLength {
			p.Length += m.Length
			continue
		}
		out = append(out, m)
	}
	return out
}
