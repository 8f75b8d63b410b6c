package unpack

import (
	"errors"
	"fmt"
	"io"
	"os"

	"golang.org/x/sys/unix"
)

// sparseChunk is the unit copySparse checks for zeros: a multiple of every common
// filesystem block size, so a skipped chunk is whole blocks left unallocated.
const sparseChunk = 64 << 10

// copySparse copies r into the new, empty file f, seeking over chunks that are all
// zeros instead of writing them. Tar readers hand out a sparse file's holes (and a
// file that is mostly zeros) as zeros; written out, a layer of a few compressed
// megabytes could allocate terabytes and fill the node's disk. Skipped, they stay
// holes and cost nothing. buf (sparseChunk bytes) is scratch space, reused across
// files; reserve, when not nil, is asked before each write. It returns the bytes
// copied (the file's size).
func copySparse(f *os.File, r io.Reader, buf []byte, reserve func(n int64) error) (int64, error) {
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
				if reserve != nil {
					if rerr := reserve(int64(m)); rerr != nil {
						return n, rerr
					}
				}
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

// ErrNoSpace means applying a layer would leave less free disk space than
// Options.MinFree.
var ErrNoSpace = errors.New("not enough free disk space")

// freeCheckEvery is how much data is written between checks of the free space: the
// filesystem must have MinFree plus this much free at each check.
const freeCheckEvery = 64 << 20

// freeSpace keeps an eye on the free space of the filesystem a layer is applied to.
type freeSpace struct {
	path    string
	min     int64
	pending int64 // written since the last check
	checked bool
}

func (s *freeSpace) reserve(n int64) error {
	if s.min <= 0 {
		return nil
	}
	s.pending += n
	if s.checked && s.pending < freeCheckEvery {
		return nil
	}
	s.pending, s.checked = 0, true
	var st unix.Statfs_t
	if err := unix.Statfs(s.path, &st); err != nil {
		return fmt.Errorf("free space of %s: %w", s.path, err)
	}
	free := int64(st.Bavail) * st.Bsize
	if free < s.min+freeCheckEvery {
		return fmt.Errorf("%w: %s has %d MiB free and %d MiB are kept free for the node", ErrNoSpace, s.path, free>>20, s.min>>20)
	}
	return nil
}
