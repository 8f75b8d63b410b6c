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

// haveAVX2 selects the 8-lane search on CPUs without AVX-512 (AMD before
// Zen 4, most Intel client parts), where the Go descent's branchy scan
// mispredicts once a level: two compares count a node instead.
var haveAVX2 = cpu.X86.HasAVX2

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

// search32AVX2 is search32AVX512 for CPUs with AVX2 only; same contract.
//
//go:noescape
func search32AVX2(keys *uint32, levels *int, nlevels int, x uint32, ms *Mapping) int

// search64AVX2 is search64AVX512 for CPUs with AVX2 only; same contract.
//
//go:noescape
func search64AVX2(keys *uint64, levels *int, nlevels int, x uint64, ms *Mapping) int

// mappingIs24Bytes fails to compile if Mapping is not the 24 bytes the
// assembly's prefetch strides assume.
var _ [24 - unsafe.Sizeof(Mapping{})]struct{}
var _ [unsafe.Sizeof(Mapping{}) - 24]struct{}
