package lsmt

import (
	"bytes"
	"errors"
	"math/rand/v2"
	"os"
	"path/filepath"
	"slices"
	"testing"
)

const testVSize = 64 << 20

// modelDisk applies the same writes to a plain byte slice.
type modelDisk []byte

func newRW(t *testing.T) (*RWLayer, string, string) {
	t.Helper()
	dir := t.TempDir()
	d, i := filepath.Join(dir, "upper.data"), filepath.Join(dir, "upper.index")
	l, err := CreateRW(d, i, CreateOptions{VirtualSize: testVSize, UserTag: "test"})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { l.Close() })
	return l, d, i
}

func randomOps(t *testing.T, r *rand.Rand, l interface {
	WriteAt([]byte, int64) (int, error)
	Discard(int64, int64) error
}, model modelDisk, n int) {
	t.Helper()
	for k := 0; k < n; k++ {
		off := int64(r.IntN(testVSize/SectorSize-2048)) * SectorSize
		ln := (1 + r.IntN(2048)) * SectorSize
		if r.IntN(6) == 0 {
			if err := l.Discard(off, int64(ln)); err != nil {
				t.Fatal(err)
			}
			clear(model[off : off+int64(ln)])
			continue
		}
		p := make([]byte, ln)
		for i := range p {
			p[i] = byte(r.Uint32())
		}
		if _, err := l.WriteAt(p, off); err != nil {
			t.Fatal(err)
		}
		copy(model[off:], p)
	}
}

func checkAll(t *testing.T, r interface {
	ReadAt([]byte, int64) (int, error)
}, model modelDisk) {
	t.Helper()
	got := make([]byte, len(model))
	for off := 0; off < len(model); off += MaxIOSize {
		if _, err := r.ReadAt(got[off:off+MaxIOSize], int64(off)); err != nil {
			t.Fatalf("read at %d: %v", off, err)
		}
	}
	if !bytes.Equal(got, model) {
		for i := range got {
			if got[i] != model[i] {
				t.Fatalf("first difference at byte %d", i)
			}
		}
	}
}

func TestRWWriteReopenSealCommit(t *testing.T) {
	r := rand.New(rand.NewPCG(7, 8))
	l, d, i := newRW(t)
	model := make(modelDisk, testVSize)
	randomOps(t, r, l, model, 300)
	checkAll(t, l, model)
	if err := l.Sync(); err != nil {
		t.Fatal(err)
	}
	if err := l.Close(); err != nil {
		t.Fatal(err)
	}
	l2, err := OpenRW(d, i)
	if err != nil {
		t.Fatal(err)
	}
	checkAll(t, l2, model)
	randomOps(t, r, l2, model, 100)
	want := l2.Mappings()
	// Commit the RW layer into a compacted layer.
	cpath := filepath.Join(t.TempDir(), "layer.commit")
	cf, _ := os.Create(cpath)
	info, err := Commit(cf, CommitSource{Mappings: want, VirtualSize: testVSize,
		Read: func(_ uint8, p []byte, off int64) error { return l2.ReadPhysical(p, off) }}, CommitOptions{ParentUUID: "abc"})
	if err != nil {
		t.Fatal(err)
	}
	cf.Close()
	if st, _ := os.Stat(cpath); st.Size() != info.Size {
		t.Fatalf("commit size %d, file %d", info.Size, st.Size())
	}
	cl := openFile(t, cpath)
	checkAll(t, cl, model)
	if ct := cl.Trailer(); ct.Flags != 0x06 || ct.IndexSize%256 != 0 || cl.Header().Flags != 0x07 ||
		ct.ParentUUID != "abc" || ct.UUID != info.UUID {
		t.Fatalf("commit trailer %+v", ct)
	}
	// Seal in place.
	si, err := l2.Seal()
	if err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(i); !os.IsNotExist(err) {
		t.Fatal("index file survived seal")
	}
	sl := openFile(t, si.Path)
	checkAll(t, sl, model)
	st := sl.Trailer()
	if st.Flags != FlagData|FlagSealed || st.IndexSize != uint64(len(want)) || st.UserTag != "test" {
		t.Fatalf("seal trailer %+v", st)
	}
	if _, err := OpenRW(d, i); err == nil {
		t.Fatal("sealed layer reopened as RW")
	}
}

// TestSealUnsynced seals without the fsync: the layer is complete and readable, the
// index file is left for the caller (SealInfo.Index), and the layer is closed.
func TestSealUnsynced(t *testing.T) {
	r := rand.New(rand.NewPCG(9, 10))
	l, _, i := newRW(t)
	model := make(modelDisk, testVSize)
	randomOps(t, r, l, model, 200)
	want := l.Mappings()
	si, err := l.SealUnsynced()
	if err != nil {
		t.Fatal(err)
	}
	if si.Index != i {
		t.Fatalf("index left %q, want %q", si.Index, i)
	}
	if _, err := os.Stat(i); err != nil {
		t.Fatalf("index file: %v", err)
	}
	if st, err := os.Stat(si.Path); err != nil || st.Size() != si.Size {
		t.Fatalf("sealed file %v, size %d", err, si.Size)
	}
	sl := openFile(t, si.Path)
	checkAll(t, sl, model)
	if st := sl.Trailer(); st.Flags != FlagData|FlagSealed || st.IndexSize != uint64(len(want)) {
		t.Fatalf("seal trailer %+v", st)
	}
	if _, err := l.WriteAt(make([]byte, SectorSize), 0); !errors.Is(err, ErrClosed) {
		t.Fatalf("write after seal: %v", err)
	}
	if err := l.Flush(); !errors.Is(err, ErrClosed) {
		t.Fatalf("flush after seal: %v", err)
	}
}

// TestCreateNoSync creates a layer without syncing it; Sync makes it durable later.
func TestCreateNoSync(t *testing.T) {
	dir := t.TempDir()
	d, i := filepath.Join(dir, "d"), filepath.Join(dir, "i")
	l, err := CreateRW(d, i, CreateOptions{VirtualSize: testVSize, NoSync: true})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := l.WriteAt(bytes.Repeat([]byte{3}, SectorSize), 0); err != nil {
		t.Fatal(err)
	}
	if err := l.StartWriteback(); err != nil {
		t.Fatal(err)
	}
	if err := l.Sync(); err != nil {
		t.Fatal(err)
	}
	if err := l.Close(); err != nil {
		t.Fatal(err)
	}
	l2, err := OpenRW(d, i)
	if err != nil {
		t.Fatal(err)
	}
	defer l2.Close()
	got := make([]byte, SectorSize)
	if _, err := l2.ReadAt(got, 0); err != nil || got[0] != 3 {
		t.Fatalf("reopened: %v %d", err, got[0])
	}
}

func openFile(t *testing.T, p string) *Layer {
	t.Helper()
	f, err := os.Open(p)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { f.Close() })
	st, _ := f.Stat()
	l, err := OpenLayer(f, st.Size(), p)
	if err != nil {
		t.Fatal(err)
	}
	return l
}

func TestSparseRW(t *testing.T) {
	dir := t.TempDir()
	d := filepath.Join(dir, "sparse.data")
	l, err := CreateRW(d, "", CreateOptions{VirtualSize: testVSize, Sparse: true})
	if err != nil {
		t.Fatal(err)
	}
	r := rand.New(rand.NewPCG(9, 9))
	model := make(modelDisk, testVSize)
	randomOps(t, r, l, model, 50)
	checkAll(t, l, model)
	l.Sync()
	l.Close()
	l2, err := OpenRW(d, "")
	if err != nil {
		t.Fatal(err)
	}
	checkAll(t, l2, model)
	si, err := l2.Seal()
	if err != nil {
		t.Fatal(err)
	}
	sl := openFile(t, si.Path)
	checkAll(t, sl, model)
	if sl.Trailer().Flags&FlagSparseRW == 0 {
		t.Fatal("sparse bit lost")
	}
}

// TestCrashTornTail: unsynced entries and a partial entry are dropped, synced
// writes survive.
func TestCrashTornTail(t *testing.T) {
	l, d, i := newRW(t)
	a := bytes.Repeat([]byte{1}, 8192)
	l.WriteAt(a, 0)
	if err := l.Sync(); err != nil {
		t.Fatal(err)
	}
	l.WriteAt(bytes.Repeat([]byte{2}, 4096), 4096)
	l.flushLocked()            // entry reaches the index file...
	os.Truncate(d, l.eof-4096) // ...but its data never reached the disk
	f, _ := os.OpenFile(i, os.O_WRONLY|os.O_APPEND, 0)
	f.Write([]byte{1, 2, 3}) // and a torn partial entry
	f.Close()
	l2, err := OpenRW(d, i)
	if err != nil {
		t.Fatal(err)
	}
	defer l2.Close()
	got := make([]byte, 8192)
	l2.ReadAt(got, 0)
	if !bytes.Equal(got, a) {
		t.Fatal("synced write lost or torn write visible")
	}
	if st, _ := os.Stat(i); (st.Size()-HeaderSize)%16 != 0 {
		t.Fatal("torn tail not truncated")
	}
}

// TestTornEntryKeepsLaterEntries: an entry whose data lies past the data file
// is dropped alone (the entries after it survive); a read-only open changes
// neither file, and a writable open neutralizes the entry durably.
func TestTornEntryKeepsLaterEntries(t *testing.T) {
	l, d, i := newRW(t)
	for k := range 3 {
		l.WriteAt(bytes.Repeat([]byte{byte(k + 1)}, 4096), int64(k)*4096)
	}
	if err := l.Sync(); err != nil {
		t.Fatal(err)
	}
	l.Close()
	idx, _ := os.ReadFile(i)
	// Entry 1 now points far past the data file.
	m := DecodeMapping(idx[HeaderSize+entrySize:])
	m.MOffset = 1 << 40
	EncodeMapping(idx[HeaderSize+entrySize:], m)
	os.WriteFile(i, idx, 0o644)
	dataBefore, _ := os.ReadFile(d)
	want := func(l *RWLayer, k int, v byte) {
		t.Helper()
		got := make([]byte, 4096)
		l.ReadAt(got, int64(k)*4096)
		if !bytes.Equal(got, bytes.Repeat([]byte{v}, 4096)) {
			t.Fatalf("block %d: got %d, want %d", k, got[0], v)
		}
	}
	ro, err := OpenRWWith(d, i, OpenOptions{ReadOnly: true})
	if err != nil {
		t.Fatal(err)
	}
	if got := ro.TornEntries(); !slices.Equal(got, []int{1}) {
		t.Fatalf("torn entries %v, want [1]", got)
	}
	want(ro, 0, 1)
	want(ro, 1, 0)
	want(ro, 2, 3)
	if _, err := ro.WriteAt(make([]byte, 512), 0); !errors.Is(err, ErrReadOnly) {
		t.Fatalf("write to read-only layer: %v", err)
	}
	if _, err := ro.Seal(); !errors.Is(err, ErrReadOnly) {
		t.Fatalf("seal of read-only layer: %v", err)
	}
	ro.Close()
	if b, _ := os.ReadFile(i); !bytes.Equal(b, idx) {
		t.Fatal("read-only open changed the index file")
	}
	if b, _ := os.ReadFile(d); !bytes.Equal(b, dataBefore) {
		t.Fatal("read-only open changed the data file")
	}
	rw, err := OpenRW(d, i)
	if err != nil {
		t.Fatal(err)
	}
	want(rw, 2, 3)
	// An append now lands where the torn entry pointed no more.
	rw.WriteAt(bytes.Repeat([]byte{9}, 4096), 3*4096)
	rw.Sync()
	rw.Close()
	if st, _ := os.Stat(i); st.Size() != int64(HeaderSize+4*entrySize) {
		t.Fatalf("index is %d bytes, want %d (entries kept, one appended)", st.Size(), HeaderSize+4*entrySize)
	}
	again, err := OpenRW(d, i)
	if err != nil {
		t.Fatal(err)
	}
	defer again.Close()
	if n := len(again.TornEntries()); n != 0 {
		t.Fatalf("%d torn entries after the writable open neutralized them", n)
	}
	want(again, 0, 1)
	want(again, 1, 0)
	want(again, 2, 3)
	want(again, 3, 9)
}

// TestCorruptEntryRefused: an entry that no crash can produce refuses the
// layer and changes nothing, as upstream does.
func TestCorruptEntryRefused(t *testing.T) {
	l, d, i := newRW(t)
	l.WriteAt(make([]byte, 4096), 0)
	l.WriteAt(make([]byte, 4096), 4096)
	l.Sync()
	l.Close()
	idx, _ := os.ReadFile(i)
	m := DecodeMapping(idx[HeaderSize:])
	m.MOffset = 2
	EncodeMapping(idx[HeaderSize:], m)
	os.WriteFile(i, idx, 0o644)
	for _, ro := range []bool{true, false} {
		if _, err := OpenRWWith(d, i, OpenOptions{ReadOnly: ro}); !errors.Is(err, ErrFormat) {
			t.Fatalf("read-only %v: moffset inside the header: %v", ro, err)
		}
	}
	if b, _ := os.ReadFile(i); !bytes.Equal(b, idx) {
		t.Fatal("refused open changed the index file")
	}
}

func TestBadInput(t *testing.T) {
	l, d, i := newRW(t)
	if _, err := l.WriteAt(make([]byte, 100), 0); !errors.Is(err, ErrAlignment) {
		t.Fatalf("unaligned write: %v", err)
	}
	if _, err := l.WriteAt(make([]byte, 512), testVSize); err == nil {
		t.Fatal("write past vsize accepted")
	}
	l.WriteAt(make([]byte, 4096), 0)
	l.Sync()
	l.Close()
	orig, _ := os.ReadFile(d)
	mut := func(name string, f func([]byte)) {
		b := bytes.Clone(orig)
		f(b)
		p := filepath.Join(t.TempDir(), "x")
		os.WriteFile(p, b, 0o644)
		if _, err := OpenRW(p, i); err == nil {
			t.Errorf("%s: accepted", name)
		}
	}
	mut("magic", func(b []byte) { b[0] = 'X' })
	mut("size", func(b []byte) { b[24] = 1 })
	mut("flags", func(b []byte) { b[28] = 0x07 })
	// A sealed layer with a lying index_size.
	path := filepath.Join(t.TempDir(), "c")
	f, _ := os.Create(path)
	Commit(f, CommitSource{Mappings: []Mapping{mp(0, 8, 8)}, VirtualSize: 1 << 20,
		Read: func(uint8, []byte, int64) error { return nil }}, CommitOptions{})
	f.Close()
	good, _ := os.ReadFile(path)
	for _, tc := range []struct {
		name string
		f    func([]byte)
	}{
		{"truncated", func(b []byte) {}},
		{"index_size", func(b []byte) { b[len(b)-HeaderSize+40] = 0xff }},
		{"index_offset", func(b []byte) { b[len(b)-HeaderSize+32+5] = 1 }},
		{"moffset", func(b []byte) { b[HeaderSize+8*SectorSize+8+3] = 0x10 }},
	} {
		b := bytes.Clone(good)
		if tc.name == "truncated" {
			b = b[:len(b)-100]
		}
		tc.f(b)
		if _, err := OpenLayer(bytes.NewReader(b), int64(len(b)), tc.name); err == nil {
			t.Errorf("%s: accepted", tc.name)
		}
	}
}

func TestHybridRW(t *testing.T) {
	dir := t.TempDir()
	d, i := filepath.Join(dir, "h.data"), filepath.Join(dir, "h.index")
	l, err := CreateRW(d, i, CreateOptions{VirtualSize: testVSize, Hybrid: true})
	if err != nil {
		t.Fatal(err)
	}
	r := rand.New(rand.NewPCG(11, 11))
	model := make(modelDisk, testVSize)
	randomOps(t, r, l, model, 300)
	checkAll(t, l, model)
	// Rewrites of already-backed data do not grow the file.
	p := bytes.Repeat([]byte{7}, 1<<20)
	l.WriteAt(p, 0)
	copy(model, p)
	st0, _ := os.Stat(d)
	for k := 0; k < 5; k++ {
		p[0] = byte(k)
		l.WriteAt(p, 0)
		copy(model, p)
	}
	st1, _ := os.Stat(d)
	if st1.Size() != st0.Size() {
		t.Fatalf("hybrid rewrite grew the data file from %d to %d", st0.Size(), st1.Size())
	}
	l.Sync()
	l.Close()
	l2, err := OpenRW(d, i)
	if err != nil {
		t.Fatal(err)
	}
	checkAll(t, l2, model)
	si, err := l2.Seal()
	if err != nil {
		t.Fatal(err)
	}
	sl := openFile(t, si.Path)
	checkAll(t, sl, model)
	if sl.Trailer().Flags&FlagHybridRW == 0 {
		t.Fatal("hybrid bit lost on seal")
	}
	if _, err := CreateRW(filepath.Join(dir, "x"), "", CreateOptions{VirtualSize: 4096, Hybrid: true, Sparse: true}); err == nil {
		t.Fatal("sparse+hybrid accepted")
	}
}
