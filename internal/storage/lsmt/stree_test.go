package lsmt

import (
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

// TestIndexLookupDifferential compares Lookup and the tree search with the
// linear reference on random indexes whose sizes straddle the tree's level
// boundaries (8 keys a node, 9 children), at every mapping edge and at
// random points.
func TestIndexLookupDifferential(t *testing.T) {
	r := rand.New(rand.NewPCG(14, 14))
	for _, n := range []int{1, 2, 7, 8, 9, 71, 72, 73, 80, 81, 647, 648, 649, 5831, 5833, 60000} {
		ms := randomMappings(r, n)
		ix, err := NewIndex(ms)
		if err != nil {
			t.Fatal(err)
		}
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
			qs = append(qs, r.Uint64N(last+40))
		}
		qs = append(qs, last+1000, 1<<49, InvalidOffset)
		for _, q := range qs {
			want := sort1(ms, q)
			if got := ix.first(q); got != want {
				t.Fatalf("n=%d first(%d) = %d, want %d", n, q, got, want)
			}
			if n > 1000 {
				continue // the linear reference is quadratic; first() covers the rest
			}
			for _, l := range []uint64{1, 8, 1 + r.Uint64N(64)} {
				if got, want := collect(ix, q, l), naiveLookup(ms, q, l); !slices.Equal(got, want) {
					t.Fatalf("n=%d Lookup(%d,%d) = %v, want %v", n, q, l, got, want)
				}
			}
		}
		// Every boundary of every mapping, for the large sizes too.
		for i, m := range ms {
			if got := ix.first(m.Offset); got != i {
				t.Fatalf("n=%d first(start of %d) = %d", n, i, got)
			}
			if got := ix.first(m.End() - 1); got != i {
				t.Fatalf("n=%d first(last sector of %d) = %d", n, i, got)
			}
			if got, want := ix.first(m.End()), sort1(ms, m.End()); got != want {
				t.Fatalf("n=%d first(end of %d) = %d, want %d", n, i, got, want)
			}
		}
	}
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
