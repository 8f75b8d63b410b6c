package lsmt

import (
	"fmt"
	"math/rand/v2"
	"testing"
)

// BenchmarkIndexLookup measures point lookups (one 4 KiB read's worth) on a
// sealed index of n segments, as upstream's lsmt_lookup benchmark does.
func BenchmarkIndexLookup(b *testing.B) {
	for _, n := range []int{1000, 1000000} {
		b.Run(fmt.Sprintf("segments=%d", n), func(b *testing.B) {
			ms := make([]Mapping, n)
			for i := range ms {
				ms[i] = Mapping{Offset: uint64(i) * 16, Length: 8, MOffset: uint64(i) * 8}
			}
			ix, _ := NewIndex(ms)
			r := rand.New(rand.NewPCG(1, 1))
			qs := make([]uint64, 4096)
			for i := range qs {
				qs[i] = r.Uint64N(uint64(n) * 16)
			}
			hits := 0
			fn := func(Mapping) bool { hits++; return true }
			b.ResetTimer()
			for i := 0; i < b.N; i++ {
				ix.Lookup(qs[i&4095], 8, fn)
			}
			b.ReportMetric(float64(b.N)/b.Elapsed().Seconds()/1e6, "Mlookups/s")
			_ = hits
		})
	}
}

func BenchmarkMutableInsert(b *testing.B) {
	ix := NewMutableIndex()
	r := rand.New(rand.NewPCG(1, 1))
	for i := 0; i < b.N; i++ {
		ix.Insert(Mapping{Offset: r.Uint64N(1 << 21), Length: 8, MOffset: uint64(i) * 8})
	}
}
