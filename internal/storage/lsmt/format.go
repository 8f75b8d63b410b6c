// Package lsmt reads and writes overlaybd LSMT layers: sealed (committed or
// sealed-in-place) read-only layers, and writable log-structured layers made of a
// data file and an index file. The byte format follows
// shared/reference/overlaybd-format.md section 1; layers written here are
// readable by upstream overlaybd and the other way round.
package lsmt

import (
	"bytes"
	"crypto/rand"
	"encoding/binary"
	"errors"
	"fmt"
	"strings"
)

// Format constants (reference 1.1).
const (
	HeaderSize   = 4096      // header and trailer each occupy one 4 KiB block
	structSize   = 390       // sizeof(HeaderTrailer), packed
	SectorSize   = 512       // all index offsets and lengths are in sectors
	MaxLength    = 16383     // longest mapping, in sectors
	MaxIOSize    = 4 << 20   // reads and writes are split into pieces of at most this
	maxRWEntries = 128000000 // C++ MAX_LSMT_INDEX_SIZE
	entrySize    = 16
)

// Header flags (reference 1.3).
const (
	FlagHeader   = 1 << 0
	FlagData     = 1 << 1
	FlagSealed   = 1 << 2
	FlagGC       = 1 << 3
	FlagSparseRW = 1 << 4
	FlagHybridRW = 1 << 5 // AgentENV; upstream calls this bit info_valid
)

var (
	magic0 = [8]byte{0x4C, 0x53, 0x4D, 0x54, 0x00, 0x01, 0x02, 0x00}
	magic1 = [16]byte{0x65, 0x7E, 0x63, 0xD2, 0x94, 0x44, 0x08, 0x4C, 0xA2, 0xD2, 0xC8, 0xEC, 0x4F, 0xCF, 0xAE, 0x8A}
)

// NilUUID is the text C++ overlaybd writes for "no parent".
const NilUUID = "00000000-0000-0000-0000-000000000000"

// Sentinel errors callers can branch on with errors.Is.
var (
	// ErrFormat marks bytes that are not a valid LSMT structure (bad magic,
	// lying sizes or offsets, unsorted or overlapping index).
	ErrFormat = errors.New("lsmt: invalid format")
	// ErrAlignment marks I/O that is not 512-byte aligned.
	ErrAlignment = errors.New("lsmt: offset or length not 512-byte aligned")
	// ErrSealed marks an attempt to open or write a sealed layer as writable.
	ErrSealed = errors.New("lsmt: layer is sealed")
	// ErrClosed marks use of a closed layer.
	ErrClosed = errors.New("lsmt: layer closed")
	// ErrReadOnly marks a change to a layer opened read-only.
	ErrReadOnly = errors.New("lsmt: layer opened read-only")
)

// Header is the HeaderTrailer struct shared by LSMT headers and trailers.
type Header struct {
	Flags       uint32 `json:"flags"`
	IndexOffset uint64 `json:"index_offset"` // bytes from the start of the file
	IndexSize   uint64 `json:"index_size"`   // number of 16-byte entries, padding included
	VirtualSize uint64 `json:"virtual_size"` // bytes of the virtual block device
	UUID        string `json:"uuid"`         // "" when absent
	ParentUUID  string `json:"parent_uuid"`  // "" when absent (nil UUID or empty field on disk)
	Version     uint8  `json:"version"`
	SubVersion  uint8  `json:"sub_version"`
	UserTag     string `json:"user_tag"`
}

// IsHeader reports whether the flags mark a header (as opposed to a trailer).
func (h *Header) IsHeader() bool { return h.Flags&FlagHeader != 0 }

// IsSealed reports the sealed flag.
func (h *Header) IsSealed() bool { return h.Flags&FlagSealed != 0 }

// IsSparse reports the sparse-RW flag.
func (h *Header) IsSparse() bool { return h.Flags&FlagSparseRW != 0 }

// MarshalBinary encodes h into a 4096-byte block. UUIDs are written as given;
// an empty ParentUUID is written as the nil UUID string, as C++ does.
func (h *Header) MarshalBinary() ([]byte, error) {
	if len(h.UUID) > 36 || len(h.ParentUUID) > 36 {
		return nil, fmt.Errorf("%w: uuid longer than 36 bytes", ErrFormat)
	}
	if len(h.UserTag) > 256 {
		return nil, fmt.Errorf("%w: user tag longer than 256 bytes", ErrFormat)
	}
	b := make([]byte, HeaderSize)
	copy(b[0:8], magic0[:])
	copy(b[8:24], magic1[:])
	le := binary.LittleEndian
	le.PutUint32(b[24:], structSize)
	le.PutUint32(b[28:], h.Flags)
	le.PutUint64(b[32:], h.IndexOffset)
	le.PutUint64(b[40:], h.IndexSize)
	le.PutUint64(b[48:], h.VirtualSize)
	uuid, parent := h.UUID, h.ParentUUID
	if uuid == "" {
		uuid = NilUUID
	}
	if parent == "" {
		parent = NilUUID
	}
	copy(b[56:92], uuid)
	copy(b[93:129], parent)
	b[132] = h.Version
	b[133] = h.SubVersion
	copy(b[134:390], h.UserTag)
	return b, nil
}

// ParseHeader decodes a HeaderTrailer block (at least 390 bytes).
func ParseHeader(b []byte) (*Header, error) {
	if len(b) < structSize {
		return nil, fmt.Errorf("%w: header block is %d bytes, want %d", ErrFormat, len(b), structSize)
	}
	if !bytes.Equal(b[0:8], magic0[:]) {
		return nil, fmt.Errorf("%w: bad magic0 % x", ErrFormat, b[0:8])
	}
	if !bytes.Equal(b[8:24], magic1[:]) {
		return nil, fmt.Errorf("%w: bad magic1", ErrFormat)
	}
	le := binary.LittleEndian
	if sz := le.Uint32(b[24:]); sz != structSize {
		return nil, fmt.Errorf("%w: struct size %d, want %d", ErrFormat, sz, structSize)
	}
	h := &Header{
		Flags:       le.Uint32(b[28:]),
		IndexOffset: le.Uint64(b[32:]),
		IndexSize:   le.Uint64(b[40:]),
		VirtualSize: le.Uint64(b[48:]),
		UUID:        parseUUID(b[56:92]), // 36 chars; byte 92 is the NUL
		ParentUUID:  parseUUID(b[93:129]),
		Version:     b[132],
		SubVersion:  b[133],
		UserTag:     cstring(b[134:390]),
	}
	return h, nil
}

func cstring(b []byte) string {
	if i := bytes.IndexByte(b, 0); i >= 0 {
		b = b[:i]
	}
	return string(b)
}

// parseUUID stops at the first NUL and maps empty or nil UUIDs to "".
// Case is preserved so that byte-exact rewrites stay possible; compare with
// strings.EqualFold.
func parseUUID(b []byte) string {
	s := cstring(b)
	if s == "" || s == NilUUID {
		return ""
	}
	return s
}

// NewUUID returns a random version-4 UUID in the uppercase text form C++
// overlaybd writes.
func NewUUID() string {
	var u [16]byte
	_, _ = rand.Read(u[:]) // crypto/rand.Read never fails on Linux
	u[6] = u[6]&0x0f | 0x40
	u[8] = u[8]&0x3f | 0x80
	return strings.ToUpper(fmt.Sprintf("%x-%x-%x-%x-%x", u[0:4], u[4:6], u[6:8], u[8:10], u[10:16]))
}
