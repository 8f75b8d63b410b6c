// Package zfile reads and writes overlaybd ZFile containers: a file split
// into fixed-size blocks, each compressed with LZ4 or zstd and followed by a
// salted CRC32C, plus a jump table (reference section 2).
package zfile

import (
	"bytes"
	"encoding/binary"
	"errors"
	"fmt"
	"hash/crc32"
)

// Format constants.
const (
	HeaderSize  = 512
	structSize  = 96
	blockCRCLen = 4
	maxBlock    = 64 << 10 // readers reject larger blocks
	minBlock    = 4 << 10
	maxBlocks   = 1000000000 // C++ index_size limit
)

// Flags (reference 2.3).
const (
	FlagHeader     = 1 << 0
	FlagData       = 1 << 1
	FlagSealed     = 1 << 2
	FlagOverwrite  = 1 << 3
	FlagCalcDigest = 1 << 4
	FlagIdxComp    = 1 << 5
)

// Algorithm identifies a block compressor.
type Algorithm uint8

// Algorithms.
const (
	AlgoLZ4  Algorithm = 1
	AlgoZstd Algorithm = 2
)

func (a Algorithm) String() string {
	switch a {
	case 0:
		return "minilzo"
	case AlgoLZ4:
		return "lz4"
	case AlgoZstd:
		return "zstd"
	}
	return fmt.Sprintf("algo(%d)", uint8(a))
}

// ParseAlgorithm maps "lz4" and "zstd" to algorithms.
func ParseAlgorithm(s string) (Algorithm, error) {
	switch s {
	case "lz4":
		return AlgoLZ4, nil
	case "zstd":
		return AlgoZstd, nil
	}
	return 0, fmt.Errorf("zfile: unknown algorithm %q (want lz4 or zstd)", s)
}

var (
	magic0 = [8]byte{'Z', 'F', 'i', 'l', 'e', 0, 1, 0}
	magic1 = [16]byte{'t', 'u', 'j', 'i', '.', 'y', 'y', 'f', '@', 'A', 'l', 'i', 'b', 'a', 'b', 'a'}
)

// Sentinel errors.
var (
	// ErrFormat marks structurally invalid ZFile bytes.
	ErrFormat = errors.New("zfile: invalid format")
	// ErrChecksum marks a CRC mismatch (header digest, jump table or block).
	ErrChecksum = errors.New("zfile: checksum mismatch")
)

var castagnoli = crc32.MakeTable(crc32.Castagnoli)

// CRC32CRaw is CRC32C with init 0 and no final xor (header digests, jump table).
func CRC32CRaw(b []byte) uint32 { return CRC32CSeed(0, b) }

// CRC32CSalt is CRC32C with init 100007 and no final xor (per-block CRC).
func CRC32CSalt(b []byte) uint32 { return CRC32CSeed(100007, b) }

// CRC32CSeed is the raw CRC32C variant with a given seed: Go's crc32 applies
// the pre- and post-inversion that the raw variant omits, so undo both.
func CRC32CSeed(seed uint32, b []byte) uint32 {
	return crc32.Update(seed^0xFFFFFFFF, castagnoli, b) ^ 0xFFFFFFFF
}

// Header is the ZFile HeaderTrailer.
type Header struct {
	Digest           uint32    `json:"digest"`
	Flags            uint64    `json:"flags"`
	IndexOffset      uint64    `json:"index_offset"`
	IndexSize        uint64    `json:"index_size"` // number of blocks
	OriginalFileSize uint64    `json:"original_file_size"`
	IndexCRC         uint32    `json:"index_crc"`
	BlockSize        uint32    `json:"block_size"`
	Algo             Algorithm `json:"algo"`
	Level            uint8     `json:"level"`
	UseDict          uint8     `json:"use_dict"`
	DictSize         uint32    `json:"dict_size"`
	Verify           bool      `json:"verify"`
}

// MarshalBinary encodes h into a 512-byte block with its digest computed.
func (h *Header) MarshalBinary() []byte {
	b := make([]byte, HeaderSize)
	copy(b[0:], magic0[:])
	copy(b[8:], magic1[:])
	le := binary.LittleEndian
	le.PutUint32(b[24:], structSize)
	le.PutUint64(b[32:], h.Flags)
	le.PutUint64(b[40:], h.IndexOffset)
	le.PutUint64(b[48:], h.IndexSize)
	le.PutUint64(b[56:], h.OriginalFileSize)
	le.PutUint32(b[64:], h.IndexCRC)
	le.PutUint32(b[72:], h.BlockSize)
	b[76] = byte(h.Algo)
	b[77] = h.Level
	b[78] = h.UseDict
	le.PutUint32(b[84:], h.DictSize)
	if h.Verify {
		b[88] = 1
	}
	h.Digest = CRC32CRaw(b)
	le.PutUint32(b[28:], h.Digest)
	return b
}

// ParseHeader decodes a 512-byte HeaderTrailer and verifies its digest when
// the CALC_DIGEST flag is set.
func ParseHeader(b []byte) (*Header, error) {
	if len(b) < HeaderSize {
		return nil, fmt.Errorf("%w: %d bytes, want %d", ErrFormat, len(b), HeaderSize)
	}
	if !bytes.Equal(b[0:8], magic0[:]) || !bytes.Equal(b[8:24], magic1[:]) {
		return nil, fmt.Errorf("%w: bad magic", ErrFormat)
	}
	le := binary.LittleEndian
	h := &Header{
		Digest:           le.Uint32(b[28:]),
		Flags:            le.Uint64(b[32:]),
		IndexOffset:      le.Uint64(b[40:]),
		IndexSize:        le.Uint64(b[48:]),
		OriginalFileSize: le.Uint64(b[56:]),
		IndexCRC:         le.Uint32(b[64:]),
		BlockSize:        le.Uint32(b[72:]),
		Algo:             Algorithm(b[76]),
		Level:            b[77],
		UseDict:          b[78],
		DictSize:         le.Uint32(b[84:]),
		Verify:           b[88] != 0,
	}
	if h.Flags&FlagCalcDigest != 0 {
		c := make([]byte, HeaderSize)
		copy(c, b[:HeaderSize])
		clear(c[28:32])
		if got := CRC32CRaw(c); got != h.Digest {
			return nil, fmt.Errorf("%w: header digest %#08x, computed %#08x", ErrChecksum, h.Digest, got)
		}
	}
	return h, nil
}

// IsZFile reports whether b (the first 512 bytes of a file) is a ZFile header.
func IsZFile(b []byte) bool {
	h, err := ParseHeader(b)
	return err == nil && h.Flags&FlagHeader != 0
}
