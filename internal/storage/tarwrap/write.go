package tarwrap

import (
	"fmt"
	"io"
	"strconv"
)

// Wrap writes payload (size bytes) to w inside the tar wrapper overlaybd's
// C++ tools produce (overlaybd-commit -t): a pax header carrying the size,
// an "overlaybd.commit" entry, the payload, padding and the tar EOF. The
// output is byte-identical to upstream's.
func Wrap(w io.Writer, payload io.Reader, size int64) error {
	pax := paxRecord("size", strconv.FormatInt(size, 10))
	h1 := make([]byte, block)
	copy(h1, "overlaybd.pax")
	putNum(h1[124:136], int64(len(pax)))
	h1[156] = 'x'
	finish(h1)
	pb := make([]byte, roundUp(int64(len(pax))))
	copy(pb, pax)
	h2 := make([]byte, block)
	copy(h2, "overlaybd.commit")
	putNum(h2[100:108], 0o644|0o100000)
	putNum(h2[108:116], 0)
	putNum(h2[116:124], 0)
	putNum(h2[124:136], 0)
	putNum(h2[136:148], 0)
	h2[156] = '0'
	copy(h2[265:], "root")
	copy(h2[297:], "root")
	finish(h2)
	for _, b := range [][]byte{h1, pb, h2} {
		if _, err := w.Write(b); err != nil {
			return fmt.Errorf("tarwrap: %w", err)
		}
	}
	n, err := io.Copy(w, payload)
	if err != nil {
		return fmt.Errorf("tarwrap: copy payload: %w", err)
	}
	if n != size {
		return fmt.Errorf("tarwrap: payload was %d bytes, declared %d", n, size)
	}
	if _, err := w.Write(make([]byte, roundUp(size)-size+2*block)); err != nil {
		return fmt.Errorf("tarwrap: %w", err)
	}
	return nil
}

// WrappedSize is the size of Wrap's output for a payload of size bytes.
func WrappedSize(size int64) int64 {
	pax := paxRecord("size", strconv.FormatInt(size, 10))
	return block + roundUp(int64(len(pax))) + block + roundUp(size) + 2*block
}

// paxRecord formats "<len> key=value\n" where len counts itself.
func paxRecord(k, v string) string {
	body := " " + k + "=" + v + "\n"
	n := len(body) + 1
	for len(strconv.Itoa(n))+len(body) != n {
		n++
	}
	return strconv.Itoa(n) + body
}

// putNum writes an octal field right-aligned with spaces, as the C++ writer
// does: width-1 characters then a space for 12-byte fields, width-2
// characters, a space and a NUL for 8-byte fields.
func putNum(f []byte, v int64) {
	digits := len(f) - 1
	if len(f) == 8 {
		digits = len(f) - 2
	}
	s := strconv.FormatInt(v, 8)
	for i := range digits {
		f[i] = ' '
	}
	copy(f[digits-len(s):], s)
	f[digits] = ' '
	if len(f) == 8 {
		f[7] = 0
	}
}

// finish computes the header checksum (field counted as spaces) and stores
// it in the 8-byte form above.
func finish(h []byte) {
	copy(h[257:], "ustar\x0000")
	for i := 148; i < 156; i++ {
		h[i] = ' '
	}
	var sum int64
	for _, c := range h {
		sum += int64(c)
	}
	putNum(h[148:156], sum)
}
