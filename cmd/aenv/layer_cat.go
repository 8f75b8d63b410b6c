package main

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"os"

	"golang.org/x/sys/unix"
)

// holeBlock is the granularity at which cat leaves zeros out of a regular file.
const holeBlock = 64 << 10

var zeroBlock [holeBlock]byte

// catRange copies n bytes of r from off to w, checking ctx between chunks so
// Ctrl-C and SIGTERM stop it whatever the virtual size.
func catRange(ctx context.Context, w catWriter, r virtualReader, off, n uint64) error {
	if ctx == nil {
		ctx = context.Background()
	}
	buf := make([]byte, 4<<20)
	for done := uint64(0); done < n; {
		if err := ctx.Err(); err != nil {
			return fmt.Errorf("cat stopped at byte %d of %d: %w", done, n, err)
		}
		k := min(uint64(len(buf)), n-done)
		got, err := r.ReadAt(buf[:k], int64(off+done))
		if got < int(k) && err == nil {
			err = io.ErrUnexpectedEOF
		}
		if err != nil && !(errors.Is(err, io.EOF) && got == int(k)) {
			return fmt.Errorf("read at %d: %w", off+done, err)
		}
		if err := w.write(buf[:k]); err != nil {
			return err
		}
		done += k
	}
	return w.finish()
}

// catWriter writes cat's output: sequentially, or, into a regular file it
// ends, leaving holes where the disk reads as zeros.
type catWriter interface {
	write(p []byte) error
	finish() error
}

func newCatWriter(w io.Writer) catWriter {
	if f, ok := w.(*os.File); ok {
		if h := newHoleWriter(f); h != nil {
			return h
		}
	}
	return plainWriter{w}
}

type plainWriter struct{ w io.Writer }

func (p plainWriter) write(b []byte) error { _, err := p.w.Write(b); return err }
func (plainWriter) finish() error          { return nil }

// holeWriter seeks over zero blocks instead of writing them. It is used only
// for a regular file positioned at its end and not opened for appending, so
// a skipped block can only be a hole, never stale bytes.
type holeWriter struct {
	f   *os.File
	pos int64
}

func newHoleWriter(f *os.File) *holeWriter {
	st, err := f.Stat()
	if err != nil || !st.Mode().IsRegular() {
		return nil
	}
	fl, err := unix.FcntlInt(f.Fd(), unix.F_GETFL, 0)
	if err != nil || fl&unix.O_APPEND != 0 {
		return nil
	}
	pos, err := f.Seek(0, io.SeekCurrent)
	if err != nil || pos != st.Size() {
		return nil
	}
	return &holeWriter{f: f, pos: pos}
}

func (h *holeWriter) write(p []byte) error {
	for len(p) > 0 {
		k := min(len(p), holeBlock)
		if !bytes.Equal(p[:k], zeroBlock[:k]) {
			if _, err := h.f.WriteAt(p[:k], h.pos); err != nil {
				return err
			}
		}
		h.pos += int64(k)
		p = p[k:]
	}
	return nil
}

// finish sets the file's size to what was written, holes included, and its
// offset after it, as sequential writes would have left them.
func (h *holeWriter) finish() error {
	st, err := h.f.Stat()
	if err != nil {
		return err
	}
	if st.Size() < h.pos {
		if err := h.f.Truncate(h.pos); err != nil {
			return err
		}
	}
	_, err = h.f.Seek(h.pos, io.SeekStart)
	return err
}
