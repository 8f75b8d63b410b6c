package unpack

import (
	"errors"
	"io"
	"os"
)

// sparseChunk is the unit copySparse checks for zeros: a multiple of every common
// filesystem block size, so a skipped chunk is whole blocks left unallocated.
const sparseChunk = 64 << 10

// copySparse copies r into the new, empty file f, seeking over chunks that are all
// zeros instead of writing them. Tar readers hand out a sparse file's holes (and a
// file that is mostly zeros) as zeros; written out, a layer of a few compressed
// megabytes could allocate terabytes and fill the node's disk. Skipped, they stay
// holes and cost nothing. buf (sparseChunk bytes) is scratch space, reused across
// files. It returns the bytes copied (the file's size).
func copySparse(f *os.File, r io.Reader, buf []byte) (int64, error) {
	var n int64
	hole := false // the file ends in a hole that Truncate must extend over
	for {
		m, err := readChunk(r, buf)
		if m > 0 {
			if allZero(buf[:m]) {
				if _, serr := f.Seek(int64(m), io.SeekCurrent); serr != nil {
					return n, serr
				}
				hole = true
			} else {
				if _, werr := f.Write(buf[:m]); werr != nil {
					return n, werr
				}
				hole = false
			}
			n += int64(m)
		}
		if errors.Is(err, io.EOF) {
			break
		}
		if err != nil {
			return n, err
		}
	}
	if hole {
		if err := f.Truncate(n); err != nil {
			return n, err
		}
	}
	return n, nil
}

// readChunk fills buf from r like io.ReadFull, but returns r's own error: io.EOF at
// the entry's end, io.ErrUnexpectedEOF only for a truncated entry.
func readChunk(r io.Reader, buf []byte) (int, error) {
	n := 0
	for n < len(buf) {
		m, err := r.Read(buf[n:])
		n += m
		if err != nil {
			return n, err
		}
	}
	return n, nil
}

// allZero reports whether b holds only zero bytes.
func allZero(b []byte) bool {
	for len(b) >= 8 {
		if b[0]|b[1]|b[2]|b[3]|b[4]|b[5]|b[6]|b[7] != 0 {
			return false
		}
		b = b[8:]
	}
	for _, c := range b {
		if c != 0 {
			return false
		}
	}
	return true
}
