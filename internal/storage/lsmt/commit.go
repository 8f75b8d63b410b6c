package lsmt

import (
	"bufio"
	"fmt"
	"io"
)

// commitPiece is the C++ compact copy granularity (BUFFER_SIZE = 32 KiB):
// each source mapping is copied in pieces of this many sectors, and each
// piece becomes one index entry before merging.
const commitPiece = 64

// CommitSource is what Commit compacts: sorted, non-overlapping mappings
// whose non-zeroed data is read through Read(tag, p, physicalByteOffset).
type CommitSource struct {
	Mappings    []Mapping
	Read        func(tag uint8, p []byte, off int64) error
	VirtualSize uint64
}

// CommitOptions set the committed layer's header fields.
type CommitOptions struct {
	UUID       string // generated when empty
	ParentUUID string
	UserTag    string
}

// CommitInfo describes a committed layer.
type CommitInfo struct {
	Size    int64 // bytes written
	UUID    string
	Entries int // valid index entries
}

// Commit writes a compacted ("committed") sealed layer to w in upstream C++
// layout: header 0x07, data packed in index order from sector 8, index merged
// with the strict C++ rule and padded to a multiple of 256 entries, trailer
// directly after the index. Zeroed mappings are kept (they hide lower data).
func Commit(w io.Writer, src CommitSource, o CommitOptions) (CommitInfo, error) {
	if o.UUID == "" {
		o.UUID = NewUUID()
	}
	h := Header{Flags: FlagHeader | FlagData | FlagSealed, VirtualSize: src.VirtualSize, UUID: o.UUID,
		ParentUUID: o.ParentUUID, UserTag: o.UserTag, Version: 1, SubVersion: 1}
	hb, err := h.MarshalBinary()
	if err != nil {
		return CommitInfo{}, err
	}
	bw := bufio.NewWriterSize(w, 1<<20)
	cw := &countWriter{w: bw}
	if _, err := cw.Write(hb); err != nil {
		return CommitInfo{}, fmt.Errorf("commit: write header: %w", err)
	}
	var out []Mapping
	add := func(m Mapping) {
		if n := len(out); n > 0 {
			p := &out[n-1]
			if p.End() == m.Offset && p.MEnd() == m.MOffset && p.Zeroed == m.Zeroed && p.Length+m.Length < MaxLength {
				p.Length += m.Length
				return
			}
		}
		out = append(out, m)
	}
	dest := uint64(HeaderSize / SectorSize)
	buf := make([]byte, MaxIOSize)
	for i, m := range src.Mappings {
		if i > 0 && m.Offset < src.Mappings[i-1].End() {
			return CommitInfo{}, fmt.Errorf("commit: %w: mapping %d overlaps its predecessor", ErrFormat, i)
		}
		if m.Zeroed {
			add(Mapping{Offset: m.Offset, Length: m.Length, MOffset: dest, Zeroed: true})
			continue
		}
		for done := uint32(0); done < m.Length; {
			k := min(m.Length-done, MaxIOSize/SectorSize)
			p := buf[:k*SectorSize]
			if err := src.Read(m.Tag, p, int64(m.MOffset+uint64(done))*SectorSize); err != nil {
				return CommitInfo{}, fmt.Errorf("commit: read mapping %d: %w", i, err)
			}
			if _, err := cw.Write(p); err != nil {
				return CommitInfo{}, fmt.Errorf("commit: write data: %w", err)
			}
			done += k
		}
		// Index pieces restart at each mapping start, as C++ does.
		for s := uint32(0); s < m.Length; s += commitPiece {
			n := min(commitPiece, m.Length-s)
			add(Mapping{Offset: m.Offset + uint64(s), Length: n, MOffset: dest})
			dest += uint64(n)
		}
	}
	indexOff := uint64(cw.n)
	k := (len(out) + 255) / 256 * 256
	eb := make([]byte, entrySize)
	for i := 0; i < k; i++ {
		if i < len(out) {
			EncodeMapping(eb, out[i])
		} else {
			copy(eb, invalidEntry[:])
		}
		if _, err := cw.Write(eb); err != nil {
			return CommitInfo{}, fmt.Errorf("commit: write index: %w", err)
		}
	}
	t := h
	t.Flags = FlagData | FlagSealed
	t.IndexOffset = indexOff
	t.IndexSize = uint64(k)
	tb, _ := t.MarshalBinary()
	if _, err := cw.Write(tb); err != nil {
		return CommitInfo{}, fmt.Errorf("commit: write trailer: %w", err)
	}
	if err := bw.Flush(); err != nil {
		return CommitInfo{}, fmt.Errorf("commit: %w", err)
	}
	return CommitInfo{Size: cw.n, UUID: o.UUID, Entries: len(out)}, nil
}

type countWriter struct {
	w io.Writer
	n int64
}

func (c *countWriter) Write(p []byte) (int, error) {
	n, err := c.w.Write(p)
	c.n += int64(n)
	return n, err
}
