package lsmt

import (
	"bytes"
	"errors"
	"fmt"
	"io"
	"os"

	"golang.org/x/sys/unix"
)

// importChunk is the granularity at which all-zero data is left out.
const importChunk = 4096

// Import converts a raw disk image into one committed layer written to w.
// Holes of the host file (SEEK_DATA/SEEK_HOLE) and all-zero 4 KiB chunks
// become unmapped ranges. The virtual size is the file size rounded up to
// 512 bytes.
func Import(w io.Writer, raw *os.File, o CommitOptions) (CommitInfo, error) {
	st, err := raw.Stat()
	if err != nil {
		return CommitInfo{}, fmt.Errorf("import: %w", err)
	}
	size := st.Size()
	vsize := uint64(size+SectorSize-1) / SectorSize * SectorSize
	var ms []Mapping
	buf := make([]byte, 1<<20)
	add := func(off int64, n int) {
		m := Mapping{Offset: uint64(off) / SectorSize, Length: uint32((n + SectorSize - 1) / SectorSize), MOffset: uint64(off) / SectorSize}
		if k := len(ms); k > 0 && ms[k-1].End() == m.Offset && ms[k-1].Length+m.Length <= MaxLength {
			ms[k-1].Length += m.Length
			return
		}
		ms = append(ms, m)
	}
	zero := make([]byte, importChunk)
	err = dataExtents(raw, size, func(b, e int64) error {
		for off := b; off < e; {
			n := int(min(int64(len(buf)), e-off))
			if _, err := raw.ReadAt(buf[:n], off); err != nil && !errors.Is(err, io.EOF) {
				return fmt.Errorf("import: read %s at %d: %w", raw.Name(), off, err)
			}
			for c := 0; c < n; c += importChunk {
				k := min(importChunk, n-c)
				if !bytes.Equal(buf[c:c+k], zero[:k]) {
					add(off+int64(c), k)
				}
			}
			off += int64(n)
		}
		return nil
	})
	if err != nil {
		return CommitInfo{}, err
	}
	return Commit(w, CommitSource{Mappings: ms, VirtualSize: vsize, Read: func(_ uint8, p []byte, off int64) error {
		return readFull(raw, p, off, raw.Name())
	}}, o)
}

// dataExtents calls fn for each data extent [b, e) of f, 4 KiB-aligned.
func dataExtents(f *os.File, size int64, fn func(b, e int64) error) error {
	fd := int(f.Fd())
	for pos := int64(0); pos < size; {
		b, err := unix.Seek(fd, pos, unix.SEEK_DATA)
		if errors.Is(err, unix.ENXIO) {
			return nil
		}
		if err != nil {
			// No SEEK_DATA support: treat the whole file as data.
			return fn(pos, size)
		}
		e, err := unix.Seek(fd, b, unix.SEEK_HOLE)
		if err != nil {
			e = size
		}
		b = b / importChunk * importChunk
		e = min((e+importChunk-1)/importChunk*importChunk, size)
		if err := fn(b, e); err != nil {
			return err
		}
		pos = e
	}
	return nil
}
