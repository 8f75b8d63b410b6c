package lsmt

import "github.com/google/btree"

// MutableIndex is the in-memory index of a writable layer. Insert follows
// upstream semantics: a new mapping replaces whatever it overlaps, keeping
// the left and right remainders of cut mappings. It is not safe for
// concurrent use; RWLayer guards it.
type MutableIndex struct {
	t *btree.BTreeG[Mapping]
}

// NewMutableIndex returns an empty index.
func NewMutableIndex() *MutableIndex {
	return &MutableIndex{t: btree.NewG(32, func(a, b Mapping) bool { return a.Offset < b.Offset })}
}

// Len is the number of mappings.
func (ix *MutableIndex) Len() int { return ix.t.Len() }

// Insert adds m, trimming or removing the mappings it overlaps.
// Zero-length mappings are ignored.
func (ix *MutableIndex) Insert(m Mapping) {
	if m.Length == 0 {
		return
	}
	var cut []Mapping
	start := m.Offset
	// The mapping starting before m may reach into it.
	ix.t.DescendLessOrEqual(Mapping{Offset: m.Offset}, func(p Mapping) bool {
		if p.End() > m.Offset {
			start = p.Offset
		}
		return false
	})
	ix.t.AscendGreaterOrEqual(Mapping{Offset: start}, func(p Mapping) bool {
		if p.Offset >= m.End() {
			return false
		}
		cut = append(cut, p)
		return true
	})
	for _, p := range cut {
		ix.t.Delete(p)
		if p.Offset < m.Offset {
			ix.t.ReplaceOrInsert(p.backwardTo(m.Offset))
		}
		if p.End() > m.End() {
			ix.t.ReplaceOrInsert(p.forwardTo(m.End()))
		}
	}
	ix.t.ReplaceOrInsert(m)
}

// Lookup calls fn for every mapping intersecting sectors [off, off+n),
// clipped, in ascending order, until fn returns false.
func (ix *MutableIndex) Lookup(off, n uint64, fn func(Mapping) bool) {
	end := off + n
	start := off
	ix.t.DescendLessOrEqual(Mapping{Offset: off}, func(p Mapping) bool {
		if p.End() > off {
			start = p.Offset
		}
		return false
	})
	ix.t.AscendGreaterOrEqual(Mapping{Offset: start}, func(p Mapping) bool {
		if p.Offset >= end {
			return false
		}
		return fn(p.clip(off, end))
	})
}

// Snapshot returns the mappings in order as a fresh slice.
func (ix *MutableIndex) Snapshot() []Mapping {
	out := make([]Mapping, 0, ix.t.Len())
	ix.t.Ascend(func(p Mapping) bool {
		out = append(out, p)
		return true
	})
	return out
}
