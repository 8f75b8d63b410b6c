//go:build !amd64

package lsmt

// haveAVX512 and haveAVX2 are false off amd64: the Go node search is the
// only one.
const (
	haveAVX512 = false
	haveAVX2   = false
)

func search32AVX512(*uint32, *int, int, uint32, *Mapping) int {
	panic("lsmt: no vector search on this architecture")
}

func search64AVX512(*uint64, *int, int, uint64, *Mapping) int {
	panic("lsmt: no vector search on this architecture")
}

func search32AVX2(*uint32, *int, int, uint32, *Mapping) int {
	panic("lsmt: no vector search on this architecture")
}

func search64AVX2(*uint64, *int, int, uint64, *Mapping) int {
	panic("lsmt: no vector search on this architecture")
}
