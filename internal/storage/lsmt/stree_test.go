package lsmt

import (
	"bytes"
	"math"
	"math/rand/v2"
	"slices"
	"sort"
	"testing"
)

// naiveLookup is the reference: a linear scan over every mapping, clipped
// with forwardTo and backwardTo as the original lookup did.
func naiveLookup(ms []Mapping, off, n uint64) []Mapping {
	var out []Mapping
	end := off + n
	for _, m := range ms {
		if m.End() <= off || m.Offset >= end {
			continue
		}
		if m.Offset < off {
			m = m.forwardTo(off)
		}
		if m.End() > end {
			m = m.backwardTo(end)
		}
		out = append(out, m)
	}
	return out
}

func collect(ix *Index, off, n uint64) []Mapping {
	var out []Mapping
	ix.Lookup(off, n, func(m Mapping) bool { out = append(out, m); return true })
	return out
}

func TestIndexLookupTable(t *testing.T) {
	z := func(off uint64, l uint32) Mapping { return Mapping{Offset: off, Length: l, MOffset: 77, Zeroed: true} }
	holes := []Mapping{mp(10, 5, 100), mp(20, 5, 200), mp(25, 5, 300), z(40, 10)}
	tests := []struct {
		name   string
		ms     []Mapping
		off, n uint64
		want   []Mapping
	}{
		{"empty index", nil, 0, 8, nil},
		{"before first", holes, 0, 10, nil},
		{"ends at first start", holes, 5, 5, nil},
		{"starts at first start", holes, 10, 2, []Mapping{mp(10, 2, 100)}},
		{"inside first", holes, 11, 2, []Mapping{mp(11, 2, 101)}},
		{"last sector of first", holes, 14, 1, []Mapping{mp(14, 1, 104)}},
		{"at first end (hole)", holes, 15, 5, nil},
		{"across hole", holes, 12, 10, []Mapping{mp(12, 3, 102), mp(20, 2, 200)}},
		{"adjacent boundary", holes, 24, 2, []Mapping{mp(24, 1, 204), mp(25, 1, 300)}},
		{"whole adjacent pair", holes, 20, 10, []Mapping{mp(20, 5, 200), mp(25, 5, 300)}},
		{"zeroed keeps moffset", holes, 45, 20, []Mapping{z(45, 5)}},
		{"at last end", holes, 50, 8, nil},
		{"past end", holes, 1 << 40, 8, nil},
		{"everything", holes, 0, 1000, holes},
		{"near invalid offset", []Mapping{mp(InvalidOffset-10, 10, 8)}, InvalidOffset - 3, 3, []Mapping{mp(InvalidOffset-3, 3, 15)}},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			ix, err := NewIndex(tc.ms)
			if err != nil {
				t.Fatal(err)
			}
			if got := collect(ix, tc.off, tc.n); !slices.Equal(got, tc.want) {
				t.Fatalf("Lookup(%d,%d) = %v, want %v", tc.off, tc.n, got, tc.want)
			}
		})
	}
}

// randomMappings returns n sorted mappings with random holes (often none, so
// many mappings are adjacent), lengths and zeroed flags.
func randomMappings(r *rand.Rand, n int) []Mapping {
	ms := make([]Mapping, n)
	pos := r.Uint64N(3)
	for i := range ms {
		if r.IntN(3) > 0 {
			pos += r.Uint64N(20)
		}
		ms[i] = Mapping{Offset: pos, Length: uint32(1 + r.IntN(16)), MOffset: r.Uint64N(1 << 40), Zeroed: r.IntN(8) == 0}
		pos = ms[i].End()
	}
	return ms
}

// searchImpls are every node search that can run here for t's key width,
// so every vector descent the CPU has and the Go descent are checked.
func searchImpls(t *stree) map[string]func(uint64) int {
	impls := map[string]func(uint64) int{"search": t.search}
	desc := func(f func(uint64) int) func(uint64) int {
		return func(x uint64) int {
			if x >= t.maxEnd {
				return t.n
			}
			return f(x)
		}
	}
	switch {
	case t.k32 != nil:
		impls["go32"] = desc(func(x uint64) int { return search32Go(t.k32, t.levels, uint32(x)) })
		if haveAVX512 {
			impls["avx32"] = desc(func(x uint64) int { return search32AVX512(&t.k32[0], &t.levels[0], len(t.levels), uint32(x), t.ms) })
		}
		if haveAVX2 {
			impls["avx2_32"] = desc(func(x uint64) int { return search32AVX2(&t.k32[0], &t.levels[0], len(t.levels), uint32(x), t.ms) })
		}
	case t.k64 != nil:
		impls["go64"] = desc(func(x uint64) int { return search64Go(t.k64, t.levels, x) })
		if haveAVX512 {
			impls["avx64"] = desc(func(x uint64) int { return search64AVX512(&t.k64[0], &t.levels[0], len(t.levels), x, t.ms) })
		}
		if haveAVX2 {
			impls["avx2_64"] = desc(func(x uint64) int { return search64AVX2(&t.k64[0], &t.levels[0], len(t.levels), x, t.ms) })
		}
	}
	return impls
}

// checkQuery compares every search implementation with sort.Search, and
// Lookup and AppendLookup with the linear reference when full is set.
func checkQuery(t *testing.T, ix *Index, impls map[string]func(uint64) int, q, l uint64, full bool) {
	t.Helper()
	want := sort1(ix.m, q)
	for name, f := range impls {
		if got := f(q); got != want {
			t.Fatalf("n=%d %s(%d) = %d, want %d", len(ix.m), name, q, got, want)
		}
	}
	if !full {
		return
	}
	ref := naiveLookup(ix.m, q, l)
	if got := collect(ix, q, l); !slices.Equal(got, ref) {
		t.Fatalf("n=%d Lookup(%d,%d) = %v, want %v", len(ix.m), q, l, got, ref)
	}
	if got := ix.AppendLookup(nil, q, l); !slices.Equal(got, ref) {
		t.Fatalf("n=%d AppendLookup(%d,%d) = %v, want %v", len(ix.m), q, l, got, ref)
	}
	// The Go descent behind Lookup, as on a CPU without AVX-512.
	noVec := *ix
	noVec.bt.vec32 = false
	if got := noVec.AppendLookup(nil, q, l); !slices.Equal(got, ref) {
		t.Fatalf("n=%d AppendLookup without vectors (%d,%d) = %v, want %v", len(ix.m), q, l, got, ref)
	}
}

// TestIndexLookupDifferential compares Lookup and the tree searches with
// the linear reference on random indexes whose sizes straddle the tree's
// level boundaries (16 keys a node and 17 children for uint32 keys, 8 and 9
// for uint64), at every mapping edge and at random points. Each index is
// checked at a low base (uint32 keys) and above 2^32 sectors (uint64 keys).
func TestIndexLookupDifferential(t *testing.T) {
	r := rand.New(rand.NewPCG(14, 14))
	sizes := []int{1, 2, 7, 8, 9, 15, 16, 17, 71, 72, 73, 80, 81, 271, 272, 273, 288, 289, 647, 648, 649,
		4623, 4624, 4625, 5831, 5833, 60000, 78609}
	for _, base := range []uint64{0, 1 << 32, 1<<49 - 1<<30} {
		for _, n := range sizes {
			ms := randomMappings(r, n)
			for i := range ms {
				ms[i].Offset += base
			}
			ix, err := NewIndex(ms)
			if err != nil {
				t.Fatal(err)
			}
			if wide := ix.bt.k64 != nil; wide != (base > 0) {
				t.Fatalf("base %d: uint64 keys = %v", base, wide)
			}
			impls := searchImpls(&ix.bt)
			full := n <= 1000 // the linear reference is quadratic; the searches cover the rest
			last := ms[n-1].End()
			var qs []uint64
			for _, i := range []int{0, 1, n / 2, n - 2, n - 1} {
				if i < 0 || i >= n {
					continue
				}
				m := ms[i]
				qs = append(qs, m.Offset, m.Offset+1, m.End()-1, m.End(), m.End()+1)
				if m.Offset > 0 {
					qs = append(qs, m.Offset-1)
				}
			}
			for range 300 {
				qs = append(qs, base+r.Uint64N(last-base+40))
			}
			qs = append(qs, 0, base/2, last+1000, 1<<49, InvalidOffset, math.MaxUint32-1, math.MaxUint32, math.MaxUint64)
			for _, q := range qs {
				for _, l := range []uint64{1, 8, 1 + r.Uint64N(64)} {
					checkQuery(t, ix, impls, q, l, full && q < math.MaxUint64-64)
				}
			}
			// Every boundary of every mapping, for the large sizes too.
			for _, m := range ms {
				for _, q := range []uint64{m.Offset - 1, m.Offset, m.End() - 1, m.End()} {
					checkQuery(t, ix, impls, q, 8, false)
				}
			}
		}
	}
}

// FuzzIndexLookup checks Lookup, AppendLookup and every tree search against
// the linear reference on indexes built from the input: each 3 bytes give a
// gap, a length and the zeroed flag of one mapping, base places the index
// (above 2^32 sectors it takes uint64 keys), and the queries are q and a
// sweep of the index's span.
func FuzzIndexLookup(f *testing.F) {
	f.Add([]byte{0, 7, 0}, uint64(0), uint64(3), uint16(8))
	f.Add([]byte{3, 7, 1, 0, 2, 0, 9, 63, 0, 0, 0, 1}, uint64(100), uint64(105), uint16(40))
	f.Add(bytes.Repeat([]byte{1, 5, 0, 0, 9, 1}, 200), uint64(1<<32-600), uint64(1<<32), uint16(16))
	f.Add(bytes.Repeat([]byte{0, 1, 0}, 400), uint64(1<<40), uint64(1<<40+77), uint16(3))
	f.Add(bytes.Repeat([]byte{31, 63, 0}, 300), uint64(InvalidOffset-30000), uint64(InvalidOffset-1), uint16(1))
	f.Fuzz(func(t *testing.T, data []byte, base, q uint64, l uint16) {
		base %= InvalidOffset
		var ms []Mapping
		pos := base
		for i := 0; i+2 < len(data); i += 3 {
			pos += uint64(data[i] % 32)
			m := Mapping{Offset: pos, Length: 1 + uint32(data[i+1]%64), MOffset: uint64(i) * 64, Zeroed: data[i+2]&1 == 1}
			if m.End() >= InvalidOffset {
				break
			}
			ms = append(ms, m)
			pos = m.End()
		}
		ix, err := NewIndex(ms)
		if err != nil {
			t.Fatal(err)
		}
		impls := searchImpls(&ix.bt)
		n := 1 + uint64(l%4096)
		checkQuery(t, ix, impls, q%(InvalidOffset+1), n, true)
		span := pos - base + 2
		for k := uint64(0); k < 64; k++ {
			checkQuery(t, ix, impls, base+k*span/64, n, true)
		}
	})
}

// sort1 is the position of the first mapping ending after q, by the standard
// library's binary search (independent of the tree).
func sort1(ms []Mapping, q uint64) int {
	return sort.Search(len(ms), func(i int) bool { return ms[i].End() > q })
}

func TestStreeExtremes(t *testing.T) {
	ix, err := NewIndex([]Mapping{mp(0, 1, 8), mp(InvalidOffset-1, 1, 9)})
	if err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct {
		q    uint64
		want int
	}{{0, 0}, {1, 1}, {InvalidOffset - 1, 1}, {InvalidOffset, 2}, {math.MaxUint64 - 1, 2}, {math.MaxUint64, 2}} {
		if got := ix.first(tc.q); got != tc.want {
			t.Errorf("first(%d) = %d, want %d", tc.q, got, tc.want)
		}
	}
	var empty Index
	if got := empty.first(5); got != 0 {
		t.Errorf("empty first = %d", got)
	}
}
