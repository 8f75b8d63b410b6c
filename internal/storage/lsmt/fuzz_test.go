package lsmt

import (
	"bytes"
	"os"
	"path/filepath"
	"testing"
)

// smallLayer is a committed layer with data, a zeroed mapping and padding.
func smallLayer(t testing.TB) []byte {
	var b bytes.Buffer
	data := bytes.Repeat([]byte{0x5a}, 64*SectorSize)
	_, err := Commit(&b, CommitSource{
		Mappings:    []Mapping{{Offset: 0, Length: 8, MOffset: 100}, {Offset: 16, Length: 4, Zeroed: true}, {Offset: 40, Length: 64, MOffset: 200}},
		VirtualSize: 1 << 20,
		Read:        func(_ uint8, p []byte, _ int64) error { copy(p, data); return nil },
	}, CommitOptions{UUID: "01BB4FCE-3EB1-B56B-05AD-F99504DAFD31", UserTag: "fuzz"})
	if err != nil {
		t.Fatal(err)
	}
	return b.Bytes()
}

func FuzzOpenLayer(f *testing.F) {
	seed := smallLayer(f)
	f.Add(seed)
	for _, pos := range []int{28, 32, 40, 48, HeaderSize, len(seed) - HeaderSize - 16*256, len(seed) - HeaderSize + 40} {
		m := bytes.Clone(seed)
		m[pos] ^= 0x41
		f.Add(m)
	}
	f.Fuzz(func(t *testing.T, b []byte) {
		l, err := OpenLayer(bytes.NewReader(b), int64(len(b)), "fuzz")
		if err != nil {
			return
		}
		ms := l.Index().Mappings()
		for i := 1; i < len(ms); i++ {
			if ms[i].Offset < ms[i-1].End() {
				t.Fatalf("accepted overlapping index")
			}
		}
		p := make([]byte, 64<<10)
		for _, off := range []int64{0, 512 * 16, int64(l.VirtualSize()) &^ 511} {
			l.ReadAt(p, off)
		}
	})
}

func FuzzParseHeader(f *testing.F) {
	h := &Header{Flags: 3, VirtualSize: 1 << 30, UUID: NewUUID(), UserTag: "x", Version: 1, SubVersion: 1}
	b, _ := h.MarshalBinary()
	f.Add(b)
	f.Fuzz(func(t *testing.T, b []byte) {
		h, err := ParseHeader(b)
		if err != nil {
			return
		}
		if len(h.UUID) > 36 || len(h.UserTag) > 256 {
			t.Fatalf("over-long fields %q %q", h.UUID, h.UserTag)
		}
	})
}

// FuzzOpenRW replays arbitrary index files against a small data file.
func FuzzOpenRW(f *testing.F) {
	dir := f.TempDir()
	d, i := filepath.Join(dir, "d"), filepath.Join(dir, "i")
	l, err := CreateRW(d, i, CreateOptions{VirtualSize: 1 << 20})
	if err != nil {
		f.Fatal(err)
	}
	l.WriteAt(make([]byte, 8192), 4096)
	l.Discard(0, 4096)
	l.Sync()
	l.Close()
	idx, _ := os.ReadFile(i)
	data, _ := os.ReadFile(d)
	f.Add(idx[HeaderSize:])
	f.Add(append(bytes.Clone(idx[HeaderSize:]), 1, 2, 3))
	f.Fuzz(func(t *testing.T, entries []byte) {
		dir := t.TempDir()
		dp, ip := filepath.Join(dir, "d"), filepath.Join(dir, "i")
		os.WriteFile(dp, data, 0o644)
		os.WriteFile(ip, append(bytes.Clone(idx[:HeaderSize]), entries...), 0o644)
		l, err := OpenRW(dp, ip)
		if err != nil {
			return
		}
		defer l.Close()
		p := make([]byte, 64<<10)
		l.ReadAt(p, 0)
		l.ReadAt(p, 1<<20-64<<10)
	})
}
