//go:build amd64

package lsmt

import (
	"unsafe"

	"golang.org/x/sys/cpu"
)

// haveAVX512 selects the vector node search: one compare counts a whole
// node, so a level costs a few instructions and no branch that can
// mispredict. It is fixed at start-up (CPU and OS support for the ZMM state).
var haveAVX512 = cpu.X86.HasAVX512F

// search32AVX512 is search32Go with a 16-lane compare per node. keys and
// levels must describe a tree built by buildStree, and x must be below the
// largest key (the padding keys are never counted). ms is the indexed
// mappings (24 bytes each, which mappingIs24Bytes checks), for prefetching
// only: the search does not read them.
//
//go:noescape
func search32AVX512(keys *uint32, levels *int, nlevels int, x uint32, ms *Mapping) int

// search64AVX512 is search64Go with an 8-lane compare per node.
//
//go:noescape
func search64AVX512(keys *uint64, levels *int, nlevels int, x uint64, ms *Mapping) int

// mappingIs24Bytes fails to compile if Mapping is not the 24 bytes the
// assembly's prefetch strides assume.
var _ [24 - unsafe.Sizeof(Mapping{})]struct{}
var _ [unsafe.Sizeof(Mapping{}) - 24]struct{}
