package lsmt

import (
	"math"
	"unsafe"
)

// nodeBytes is the size of a tree node: one cache line, so each level of a
// search costs at most one cache miss.
const nodeBytes = 64

// stree is a static, implicit B+tree (the "S+tree" layout, as upstream's
// linearized B+tree) over the sorted mapping ends of a sealed index. It
// answers "how many ends are <= x", which is the position of the first
// mapping ending after x. Nodes have no pointers: the children of node k are
// nodes k*(B+1) .. k*(B+1)+B of the next level, and the leaf level is the
// sorted ends themselves, so the search ends on the mapping's position.
//
// Keys are uint32 (16 a node) when every end fits, as in any device under
// 2 TiB, and uint64 (8 a node) otherwise: the wider fan-out saves a level,
// which at 1M mappings is one cache miss less (5 levels instead of 7).
type stree struct {
	// k32 or k64 holds the internal levels, root first, then the leaves;
	// each level padded to whole nodes with the key type's maximum and the
	// whole 64-byte aligned. Exactly one is set for a non-empty index.
	k32 []uint32
	k64 []uint64
	// levels are the start of each level in keys, root first, leaves last.
	levels []int
	n      int    // number of real keys
	maxEnd uint64 // largest end; queries at or past it skip the descent
	// ms is the first indexed mapping, which the vector search prefetches
	// the found leaf's mappings from.
	ms *Mapping
	// vec32 marks the common case, a uint32 tree on a CPU with AVX-512 or
	// AVX2, which Index lookups call straight into (see Index.Lookup).
	vec32 bool
}

func newStree(ms []Mapping) stree {
	n := len(ms)
	if n == 0 {
		return stree{}
	}
	t := stree{n: n, maxEnd: ms[n-1].End(), ms: &ms[0]}
	// Strictly below: the padding key (MaxUint32) must exceed every query
	// that descends, and those are below maxEnd.
	if t.maxEnd < math.MaxUint32 {
		t.k32, t.levels = buildStree[uint32](ms)
		t.vec32 = haveAVX512 || haveAVX2
	} else {
		t.k64, t.levels = buildStree[uint64](ms)
	}
	return t
}

func buildStree[K uint32 | uint64](ms []Mapping) ([]K, []int) {
	n := len(ms)
	b := nodeBytes / int(unsafe.Sizeof(K(0)))
	nleaf := (n + b - 1) / b
	// Node counts per internal level, bottom (just above the leaves) first.
	var counts []int
	for c := nleaf; c > 1; {
		c = (c + b) / (b + 1)
		counts = append(counts, c)
	}
	total := nleaf * b
	for _, c := range counts {
		total += c * b
	}
	keys := alignedKeys[K](total)
	key := func(i int) K {
		if i < n {
			return K(ms[i].End())
		}
		return ^K(0)
	}
	var levels []int
	pos := 0
	for h := len(counts); h >= 1; h-- {
		levels = append(levels, pos)
		// A child of a level-h node spans (B+1)^(h-1) leaf nodes.
		span := 1
		for range h - 1 {
			span *= b + 1
		}
		for k := range counts[h-1] {
			for j := range b {
				child := k*(b+1) + j + 1
				// The key is the first end in the child's subtree: a query
				// counted past it belongs in that child or further right.
				first := child * span * b
				if child*span >= nleaf {
					first = n
				}
				keys[pos] = key(first)
				pos++
			}
		}
	}
	levels = append(levels, pos)
	for i := range nleaf * b {
		keys[pos+i] = key(i)
	}
	return keys, levels
}

// alignedKeys returns n keys starting on a 64-byte boundary, so that every
// node is exactly one cache line.
func alignedKeys[K uint32 | uint64](n int) []K {
	size := int(unsafe.Sizeof(K(0)))
	per := nodeBytes / size
	buf := make([]K, n+per)
	skip := 0
	if rem := int(uintptr(unsafe.Pointer(&buf[0])) % nodeBytes); rem != 0 {
		skip = (nodeBytes - rem) / size
	}
	return buf[skip : skip+n : skip+n]
}

// search returns the number of ends <= x, i.e. the position of the first
// mapping that ends after sector x (n when none does).
func (t *stree) search(x uint64) int {
	if x >= t.maxEnd {
		// Also keeps the descent away from padding keys, which only a
		// query of the key type's maximum would count.
		return t.n
	}
	if t.vec32 {
		return t.search32(x)
	}
	if t.k32 != nil {
		return search32Go(t.k32, t.levels, uint32(x))
	}
	if haveAVX512 {
		return search64AVX512(&t.k64[0], &t.levels[0], len(t.levels), x, t.ms)
	}
	if haveAVX2 {
		return search64AVX2(&t.k64[0], &t.levels[0], len(t.levels), x, t.ms)
	}
	return search64Go(t.k64, t.levels, x)
}

// search32 is the vector descent of a uint32 tree; t.vec32 must be set and
// x below t.maxEnd.
func (t *stree) search32(x uint64) int {
	if haveAVX512 {
		return search32AVX512(&t.k32[0], &t.levels[0], len(t.levels), uint32(x), t.ms)
	}
	return search32AVX2(&t.k32[0], &t.levels[0], len(t.levels), uint32(x), t.ms)
}

// search32Go descends a uint32 tree: at each level it counts the keys <= x
// in one node, which picks the child (k*(B+1) + c); at the leaf level the
// count lands on a position (k*B + c) instead, hence k - parent.
func search32Go(keys []uint32, levels []int, x uint32) int {
	k, parent := 0, 0
	for _, lv := range levels {
		node := (*[nodeBytes / 4]uint32)(keys[lv+k*(nodeBytes/4):])
		// A branchy scan, on purpose: without vector compares the
		// predicted branches let the CPU start loading the next level's
		// node before this one is counted.
		c := 0
		for c < len(node) && node[c] <= x {
			c++
		}
		parent = k
		k = k*(len(node)+1) + c
	}
	return k - parent
}

// search64Go is search32Go for uint64 keys (8 a node).
func search64Go(keys []uint64, levels []int, x uint64) int {
	k, parent := 0, 0
	for _, lv := range levels {
		node := (*[nodeBytes / 8]uint64)(keys[lv+k*(nodeBytes/8):])
		c := 0
		for c < len(node) && node[c] <= x {
			c++
		}
		parent = k
		k = k*(len(node)+1) + c
	}
	return k - parent
}
