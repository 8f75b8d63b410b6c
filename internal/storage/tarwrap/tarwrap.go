// Package tarwrap detects and strips the single-file tar wrapper that
// overlaybd layer blobs carry in registries (reference section 1.18).
package tarwrap

import (
	"errors"
	"fmt"
	"io"
	"strconv"
	"strings"
)

const block = 512

// ErrFormat marks a tar wrapper whose fields are inconsistent.
var ErrFormat = errors.New("tarwrap: invalid tar wrapper")

// Info describes a wrapped payload.
type Info struct {
	Name          string `json:"name"`     // entry name, e.g. "overlaybd.commit"
	PaxSize       int64  `json:"pax_size"` // size from the pax record, 0 when absent
	PayloadOffset int64  `json:"payload_offset"`
	PayloadSize   int64  `json:"payload_size"`
}

// Detect reports whether r starts with a valid ustar header and, if so, where
// the payload lies. A blob that is not a tar returns (nil, nil).
func Detect(r io.ReaderAt, size int64) (*Info, error) {
	if size < block {
		return nil, nil
	}
	h := make([]byte, block)
	if _, err := r.ReadAt(h, 0); err != nil {
		return nil, fmt.Errorf("tarwrap: read header: %w", err)
	}
	if !isUstar(h) {
		return nil, nil
	}
	info := &Info{PayloadOffset: block}
	if h[156] == 'x' {
		paxLen, err := octal(h[124:136])
		if err != nil {
			return nil, fmt.Errorf("%w: pax header size at offset 124: %v", ErrFormat, err)
		}
		if paxLen > 1<<20 || block+roundUp(paxLen)+block > size {
			return nil, fmt.Errorf("%w: pax data of %d bytes exceeds blob size %d", ErrFormat, paxLen, size)
		}
		pax := make([]byte, paxLen)
		if _, err := r.ReadAt(pax, block); err != nil {
			return nil, fmt.Errorf("tarwrap: read pax data: %w", err)
		}
		info.PaxSize, err = paxSize(pax)
		if err != nil {
			return nil, err
		}
		off := block + roundUp(paxLen)
		if _, err := r.ReadAt(h, off); err != nil {
			return nil, fmt.Errorf("tarwrap: read entry header at %d: %w", off, err)
		}
		if !isUstar(h) {
			return nil, fmt.Errorf("%w: no valid ustar header at offset %d after pax header", ErrFormat, off)
		}
		info.PayloadOffset = off + block
	}
	info.Name = cstr(h[0:100])
	sz, err := octal(h[124:136])
	if err != nil {
		return nil, fmt.Errorf("%w: size field at offset %d: %v", ErrFormat, info.PayloadOffset-block+124, err)
	}
	info.PayloadSize = sz
	if info.PaxSize > 0 {
		info.PayloadSize = info.PaxSize
	}
	if info.PayloadSize < 0 || info.PayloadOffset+info.PayloadSize > size {
		return nil, fmt.Errorf("%w: payload [%d, +%d) exceeds blob size %d", ErrFormat,
			info.PayloadOffset, info.PayloadSize, size)
	}
	return info, nil
}

// Open returns the payload of a wrapped blob, or the blob itself when it is
// not a tar.
func Open(r io.ReaderAt, size int64) (*Section, *Info, error) {
	info, err := Detect(r, size)
	if err != nil || info == nil {
		return &Section{r: r, size: size}, nil, err
	}
	return &Section{r: r, off: info.PayloadOffset, size: info.PayloadSize}, info, nil
}

// Section is a byte range of an underlying reader. Unlike io.SectionReader
// it forwards Evict, so consumers that verify checksums can ask a caching
// source to refetch.
type Section struct {
	r    io.ReaderAt
	off  int64
	size int64
}

// Size is the section length.
func (s *Section) Size() int64 { return s.size }

// ReadAt reads within the section.
func (s *Section) ReadAt(p []byte, off int64) (int, error) {
	if off < 0 || off >= s.size {
		return 0, io.EOF
	}
	want := p[:min(int64(len(p)), s.size-off)]
	n, err := s.r.ReadAt(want, s.off+off)
	if err == nil && len(want) < len(p) {
		err = io.EOF
	}
	return n, err
}

// Evict forwards to the underlying reader when it can evict.
func (s *Section) Evict(off, n int64) {
	if e, ok := s.r.(interface{ Evict(off, n int64) }); ok {
		e.Evict(s.off+off, n)
	}
}

func roundUp(n int64) int64 { return (n + block - 1) / block * block }

func isUstar(h []byte) bool {
	if string(h[257:262]) != "ustar" || h[262] != 0 && h[262] != ' ' {
		return false
	}
	want, err := octal(h[148:156])
	if err != nil {
		return false
	}
	var u, s int64
	for i, c := range h {
		if i >= 148 && i < 156 {
			c = ' '
		}
		u += int64(c)
		s += int64(int8(c))
	}
	return want == u || want == s
}

// octal parses a numeric tar field leniently: leading spaces and NULs are
// skipped, parsing stops at a space or NUL.
func octal(f []byte) (int64, error) {
	s := strings.TrimLeft(string(f), " \x00")
	if i := strings.IndexAny(s, " \x00"); i >= 0 {
		s = s[:i]
	}
	if s == "" {
		return 0, nil
	}
	v, err := strconv.ParseInt(s, 8, 64)
	if err != nil {
		return 0, fmt.Errorf("bad octal %q", s)
	}
	return v, nil
}

func paxSize(pax []byte) (int64, error) {
	for len(pax) > 0 && pax[0] != 0 {
		sp := strings.IndexByte(string(pax), ' ')
		if sp <= 0 {
			return 0, fmt.Errorf("%w: malformed pax record", ErrFormat)
		}
		n, err := strconv.Atoi(string(pax[:sp]))
		if err != nil || n <= sp+1 || n > len(pax) {
			return 0, fmt.Errorf("%w: malformed pax record length %q", ErrFormat, pax[:sp])
		}
		rec := strings.TrimSuffix(string(pax[sp+1:n]), "\n")
		if v, ok := strings.CutPrefix(rec, "size="); ok {
			sz, err := strconv.ParseInt(v, 10, 64)
			if err != nil || sz < 0 {
				return 0, fmt.Errorf("%w: bad pax size %q", ErrFormat, v)
			}
			return sz, nil
		}
		pax = pax[n:]
	}
	return 0, nil
}

func cstr(b []byte) string {
	for i, c := range b {
		if c == 0 {
			return string(b[:i])
		}
	}
	return string(b)
}
