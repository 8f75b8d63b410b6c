package zfile

import (
	"bytes"
	"errors"
	"io"
	"math/rand/v2"
	"os"
	"path/filepath"
	"testing"
)

func TestCRCCheckValues(t *testing.T) {
	in := []byte("123456789")
	if got := CRC32CRaw(in); got != 0x58E3FA20 {
		t.Errorf("raw %#x", got)
	}
	if got := CRC32CSalt(in); got != 0x3C9BD4E0 {
		t.Errorf("salted %#x", got)
	}
	if got := CRC32CRaw(nil); got != 0 {
		t.Errorf("raw empty %#x", got)
	}
}

// sample mixes compressible, zero and random blocks.
func sample(n int) []byte {
	r := rand.New(rand.NewPCG(1, 1))
	b := make([]byte, n)
	for i := 0; i < n; i += 4096 {
		switch (i / 4096) % 3 {
		case 0:
			copy(b[i:], bytes.Repeat([]byte("aenv overlaybd "), 300))
		case 1:
			for j := i; j < min(n, i+4096); j++ {
				b[j] = byte(r.Uint32())
			}
		}
	}
	return b
}

func build(t testing.TB, data []byte, o WriterOptions, toFile bool) []byte {
	t.Helper()
	var out []byte
	if toFile {
		p := filepath.Join(t.TempDir(), "z")
		f, _ := os.Create(p)
		w, err := NewWriter(f, o)
		if err != nil {
			t.Fatal(err)
		}
		w.Write(data)
		if err := w.Close(); err != nil {
			t.Fatal(err)
		}
		f.Close()
		out, _ = os.ReadFile(p)
	} else {
		var buf bytes.Buffer
		w, _ := NewWriter(&buf, o)
		w.Write(data)
		if err := w.Close(); err != nil {
			t.Fatal(err)
		}
		out = buf.Bytes()
	}
	return out
}

func TestRoundTrip(t *testing.T) {
	data := sample(1<<20 + 1234)
	for _, tc := range []struct {
		name   string
		o      WriterOptions
		toFile bool
	}{
		{"lz4-4k-file", WriterOptions{Algo: AlgoLZ4}, true},
		{"lz4-64k-stream", WriterOptions{Algo: AlgoLZ4, BlockSize: 64 << 10}, false},
		{"zstd-4k-file", WriterOptions{Algo: AlgoZstd}, true},
		{"zstd-16k-noverify", WriterOptions{Algo: AlgoZstd, BlockSize: 16 << 10, NoVerify: true}, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			z := build(t, data, tc.o, tc.toFile)
			r, err := Open(bytes.NewReader(z), int64(len(z)), tc.name)
			if err != nil {
				t.Fatal(err)
			}
			defer r.Close()
			wantFlags := uint64(0x13)
			if tc.toFile {
				wantFlags = 0x1B
			}
			if r.Header().Flags != wantFlags || r.Trailer().Flags&0x16 != 0x16 && !tc.toFile {
				t.Fatalf("flags %#x / %#x", r.Header().Flags, r.Trailer().Flags)
			}
			if r.Size() != int64(len(data)) {
				t.Fatalf("size %d", r.Size())
			}
			got := make([]byte, len(data))
			if n, err := r.ReadAt(got, 0); n != len(data) || err != nil {
				t.Fatalf("read %d %v", n, err)
			}
			if !bytes.Equal(got, data) {
				t.Fatal("mismatch")
			}
			rr := rand.New(rand.NewPCG(2, 2))
			for i := 0; i < 200; i++ {
				off := rr.IntN(len(data))
				n := min(1+rr.IntN(100000), len(data)-off)
				p := make([]byte, n)
				if _, err := r.ReadAt(p, int64(off)); err != nil && err != io.EOF {
					t.Fatal(err)
				}
				if !bytes.Equal(p, data[off:off+n]) {
					t.Fatalf("random read %d+%d", off, n)
				}
			}
		})
	}
}

func TestCorruption(t *testing.T) {
	data := sample(256 << 10)
	z := build(t, data, WriterOptions{}, true)
	r0, _ := Open(bytes.NewReader(z), int64(len(z)), "ok")
	jt := int(r0.Trailer().IndexOffset)
	for _, tc := range []struct {
		name string
		f    func([]byte) []byte
		open bool // error expected at open rather than read
		is   error
	}{
		{"block bit flip", func(b []byte) []byte { b[HeaderSize+10] ^= 1; return b }, false, ErrChecksum},
		{"header digest", func(b []byte) []byte { b[100] ^= 1; return b }, true, ErrChecksum},
		{"jump table", func(b []byte) []byte { b[jt+1] ^= 1; return b }, true, ErrChecksum},
		{"truncated", func(b []byte) []byte { return b[:len(b)-700] }, true, nil},
		{"magic", func(b []byte) []byte { b[0] = 'X'; return b }, true, ErrFormat},
	} {
		t.Run(tc.name, func(t *testing.T) {
			b := tc.f(bytes.Clone(z))
			r, err := Open(bytes.NewReader(b), int64(len(b)), tc.name)
			if tc.open {
				if err == nil || tc.is != nil && !errors.Is(err, tc.is) {
					t.Fatalf("open: %v", err)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			if err := r.Verify(); !errors.Is(err, tc.is) {
				t.Fatalf("verify: %v", err)
			}
		})
	}
}

// evictingReader corrupts the first read of a range and heals on Evict.
type evictingReader struct {
	b       []byte
	bad     bool
	evicted int
}

func (e *evictingReader) ReadAt(p []byte, off int64) (int, error) {
	n := copy(p, e.b[off:])
	if e.bad && off <= HeaderSize && off+int64(n) > HeaderSize {
		p[HeaderSize-off] ^= 0xff
	}
	return n, nil
}
func (e *evictingReader) Evict(off, n int64) { e.bad = false; e.evicted++ }

func TestEvictAndRetry(t *testing.T) {
	data := sample(64 << 10)
	z := build(t, data, WriterOptions{}, true)
	er := &evictingReader{b: z}
	r, err := Open(er, int64(len(z)), "e")
	if err != nil {
		t.Fatal(err)
	}
	er.bad = true
	got := make([]byte, len(data))
	if _, err := r.ReadAt(got, 0); err != nil || !bytes.Equal(got, data) || er.evicted != 1 {
		t.Fatalf("err %v evicted %d", err, er.evicted)
	}
}
