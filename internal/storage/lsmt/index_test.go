package lsmt

import (
	"math/rand/v2"
	"slices"
	"testing"
)

func mp(off uint64, l uint32, mo uint64) Mapping { return Mapping{Offset: off, Length: l, MOffset: mo} }

func TestMutableInsertVector(t *testing.T) {
	ix := NewMutableIndex()
	for _, m := range []Mapping{mp(0, 20, 0), mp(10, 15, 50), mp(30, 100, 20), mp(5, 10, 3), mp(40, 10, 123),
		mp(200, 10, 2133), mp(150, 100, 21)} {
		ix.Insert(m)
	}
	want := []Mapping{mp(0, 5, 0), mp(5, 10, 3), mp(15, 10, 55), mp(30, 10, 20), mp(40, 10, 123), mp(50, 80, 40), mp(150, 100, 21)}
	if got := ix.Snapshot(); !slices.Equal(got, want) {
		t.Fatalf("got %v\nwant %v", got, want)
	}
}

func TestMergeVector(t *testing.T) {
	upper, _ := NewIndex([]Mapping{mp(5, 5, 0), mp(10, 10, 50), mp(100, 10, 20)})
	lower, _ := NewIndex([]Mapping{mp(0, 1, 7), mp(2, 4, 5), mp(15, 10, 22), mp(30, 15, 89), mp(87, 50, 32), mp(150, 10, 84)})
	got := Merge([]*Index{upper, lower}).Mappings()
	tg := func(m Mapping, t uint8) Mapping { m.Tag = t; return m }
	want := []Mapping{tg(mp(0, 1, 7), 1), tg(mp(2, 3, 5), 1), tg(mp(5, 5, 0), 0), tg(mp(10, 10, 50), 0), tg(mp(20, 5, 27), 1),
		tg(mp(30, 15, 89), 1), tg(mp(87, 13, 32), 1), tg(mp(100, 10, 20), 0), tg(mp(110, 27, 55), 1), tg(mp(150, 10, 84), 1)}
	// Upstream numbers tags top-first: 0 = newest. The reference vector prints
	// the upper as t1 because there the upper sits above one lower (combo).
	if !slices.Equal(got, want) {
		t.Fatalf("got %v\nwant %v", got, want)
	}
}

func TestCompressVector(t *testing.T) {
	tests := []struct {
		name string
		in   []Mapping
		want []Mapping
	}{
		{"reference", []Mapping{mp(5, 5, 0), mp(10, 10, 5), mp(20, 10, 15), mp(100, 10, 20)}, []Mapping{mp(5, 25, 0), mp(100, 10, 20)}},
		{"moffset gap", []Mapping{mp(0, 5, 0), mp(5, 5, 6)}, []Mapping{mp(0, 5, 0), mp(5, 5, 6)}},
		{"tag change", []Mapping{mp(0, 5, 0), {Offset: 5, Length: 5, MOffset: 5, Tag: 1}}, []Mapping{mp(0, 5, 0), {Offset: 5, Length: 5, MOffset: 5, Tag: 1}}},
		{"strict max", []Mapping{mp(0, 16000, 0), mp(16000, 383, 16000)}, []Mapping{mp(0, 16000, 0), mp(16000, 383, 16000)}},
		{"below max", []Mapping{mp(0, 16000, 0), mp(16000, 382, 16000)}, []Mapping{mp(0, 16382, 0)}},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			if got := Compress(tc.in); !slices.Equal(got, tc.want) {
				t.Fatalf("got %v want %v", got, tc.want)
			}
		})
	}
}

func TestEncodeDecodeMapping(t *testing.T) {
	var b [16]byte
	EncodeMapping(b[:], mp(0, 8448, 8))
	if want := [16]byte{0, 0, 0, 0, 0, 0, 0, 0x84, 8}; b != want {
		t.Fatalf("entry 0 % x", b)
	}
	EncodeMapping(b[:], mp(12288, 256, 8456))
	if want := [16]byte{0, 0x30, 0, 0, 0, 0, 0, 0x04, 0x08, 0x21}; b != want {
		t.Fatalf("entry 1 % x", b)
	}
	m := Mapping{Offset: InvalidOffset - 1, Length: MaxLength, MOffset: maxMOffset, Zeroed: true, Tag: 255}
	EncodeMapping(b[:], m)
	if got := DecodeMapping(b[:]); got != m {
		t.Fatalf("round trip %+v != %+v", got, m)
	}
	if !DecodeMapping(invalidEntry[:]).IsPadding() {
		t.Fatal("invalid entry not padding")
	}
}

// model is a per-sector reference: value = moffset of the sector or -1.
func applyModel(model map[uint64]uint64, m Mapping) {
	for s := uint64(0); s < uint64(m.Length); s++ {
		model[m.Offset+s] = m.MOffset + s
	}
}

func TestMutableRandomAgainstModel(t *testing.T) {
	r := rand.New(rand.NewPCG(1, 2))
	ix := NewMutableIndex()
	model := map[uint64]uint64{}
	var phys uint64 = 8
	for i := 0; i < 3000; i++ {
		m := mp(r.Uint64N(2000), uint32(1+r.IntN(64)), phys)
		phys += uint64(m.Length)
		ix.Insert(m)
		applyModel(model, m)
	}
	got := map[uint64]uint64{}
	ms := ix.Snapshot()
	for i, m := range ms {
		if i > 0 && m.Offset < ms[i-1].End() {
			t.Fatalf("overlap at %d", i)
		}
		applyModel(got, m)
	}
	if len(got) != len(model) {
		t.Fatalf("sectors %d want %d", len(got), len(model))
	}
	for k, v := range model {
		if got[k] != v {
			t.Fatalf("sector %d -> %d want %d", k, got[k], v)
		}
	}
	// Lookup clipping agrees with Index lookup over the same mappings.
	imm, err := NewIndex(ms)
	if err != nil {
		t.Fatal(err)
	}
	for i := 0; i < 500; i++ {
		off, n := r.Uint64N(2100), 1+r.Uint64N(200)
		var a, b []Mapping
		ix.Lookup(off, n, func(m Mapping) bool { a = append(a, m); return true })
		imm.Lookup(off, n, func(m Mapping) bool { b = append(b, m); return true })
		if !slices.Equal(a, b) {
			t.Fatalf("lookup(%d,%d): %v vs %v", off, n, a, b)
		}
		for _, m := range a {
			if m.Offset < off || m.End() > off+n {
				t.Fatalf("not clipped: %+v", m)
			}
		}
	}
}

func TestOverlayAgainstMutable(t *testing.T) {
	r := rand.New(rand.NewPCG(3, 4))
	for iter := 0; iter < 50; iter++ {
		mk := func(base uint64) []Mapping {
			ix := NewMutableIndex()
			for i := 0; i < 40; i++ {
				ix.Insert(Mapping{Offset: r.Uint64N(500), Length: uint32(1 + r.IntN(40)), MOffset: base + uint64(i)*100, Zeroed: r.IntN(5) == 0})
			}
			return ix.Snapshot()
		}
		top, bottom := mk(0), mk(10000)
		ref := NewMutableIndex()
		for _, m := range bottom {
			ref.Insert(m)
		}
		for _, m := range top {
			ref.Insert(m)
		}
		if got, want := Overlay(top, bottom), ref.Snapshot(); !slices.Equal(got, want) {
			t.Fatalf("overlay\n got %v\nwant %v", got, want)
		}
	}
}

func TestNewIndexRejectsOverlap(t *testing.T) {
	if _, err := NewIndex([]Mapping{mp(0, 10, 8), mp(5, 10, 30)}); err == nil {
		t.Fatal("overlap accepted")
	}
	if _, err := NewIndex([]Mapping{mp(10, 10, 8), mp(0, 5, 30)}); err == nil {
		t.Fatal("unsorted accepted")
	}
}

func TestIndexFirstMatchesLinear(t *testing.T) {
	r := rand.New(rand.NewPCG(8, 8))
	for _, n := range []int{0, 1, 2, 3, 7, 8, 100, 1023} {
		ms := make([]Mapping, n)
		pos := uint64(0)
		for i := range ms {
			pos += r.Uint64N(5)
			ms[i] = mp(pos, uint32(1+r.IntN(4)), 8)
			pos = ms[i].End()
		}
		ix, err := NewIndex(ms)
		if err != nil {
			t.Fatal(err)
		}
		for q := uint64(0); q <= pos+2; q++ {
			want := len(ms)
			for i, m := range ms {
				if m.End() > q {
					want = i
					break
				}
			}
			if got := ix.first(q); got != want {
				t.Fatalf("n=%d first(%d) = %d, want %d", n, q, got, want)
			}
		}
	}
}
