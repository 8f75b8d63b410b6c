package blob

import (
	"bytes"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"io"
	"os"
	"strings"
	"testing"

	"github.com/aenv-dev/aenv/internal/storage/lsmt"
	"github.com/aenv-dev/aenv/internal/storage/zfile"
)

const hwLayer = "testdata/hw_layer.bin"

func sum(b []byte) string { s := sha256.Sum256(b); return hex.EncodeToString(s[:]) }

func openHW(t *testing.T) (*Layer, []byte) {
	t.Helper()
	raw, err := os.ReadFile(hwLayer)
	if err != nil {
		t.Fatal(err)
	}
	l, err := Open(bytes.NewReader(raw), int64(len(raw)), hwLayer)
	if err != nil {
		t.Fatalf("Open: %v", err)
	}
	t.Cleanup(func() { l.Close() })
	return l, raw
}

// TestGoldenHWLayer checks every fact of shared/testdata/overlaybd/README.md.
func TestGoldenHWLayer(t *testing.T) {
	l, raw := openHW(t)
	if len(raw) != 642560 || sum(raw) != "022231c3f1af70e0cc42f0c3781eabf174cff608210585bf93fc83e16d33672d" {
		t.Fatalf("blob size %d sha %s", len(raw), sum(raw))
	}
	// Tar.
	if l.Tar == nil || l.Tar.PaxSize != 639491 || l.Tar.Name != "overlaybd.commit" || l.Tar.PayloadOffset != 1536 ||
		l.Tar.PayloadSize != 639491 {
		t.Fatalf("tar info %+v", l.Tar)
	}
	// ZFile.
	z := l.ZFile
	if z == nil {
		t.Fatal("payload not detected as ZFile")
	}
	h, tr := z.Header(), z.Trailer()
	for _, c := range []struct {
		name      string
		got, want uint64
	}{
		{"header flags", h.Flags, 0x1B},
		{"header digest", uint64(h.Digest), 0x0F1F3445},
		{"trailer flags", tr.Flags, 0x1B}, // overwritten header carries the index fields
		{"index_offset", tr.IndexOffset, 569127},
		{"index_size", tr.IndexSize, 17463},
		{"original size", tr.OriginalFileSize, 71528448},
		{"index_crc", uint64(tr.IndexCRC), 0x6DBA55B0},
		{"block size", uint64(tr.BlockSize), 4096},
		{"algo", uint64(tr.Algo), uint64(zfile.AlgoLZ4)},
	} {
		if c.got != c.want {
			t.Errorf("%s = %#x, want %#x", c.name, c.got, c.want)
		}
	}
	if !tr.Verify || tr.DictSize != 0 {
		t.Errorf("verify %v dict %d", tr.Verify, tr.DictSize)
	}
	if rt, ok := z.RawTrailer(); !ok || rt.Flags != 0x16 || rt.Digest != 0xFFDFE161 {
		t.Errorf("raw trailer %+v %v", rt, ok)
	}
	// The real trailer block at payload offset 638979.
	trl, err := zfile.ParseHeader(raw[1536+638979 : 1536+638979+512])
	if err != nil || trl.Flags != 0x16 || trl.Digest != 0xFFDFE161 {
		t.Fatalf("trailer: %+v %v", trl, err)
	}
	lens := map[int]bool{}
	minL, maxL := 1<<30, 0
	for i := 0; i < z.Blocks(); i++ {
		n := z.BlockLength(i)
		minL, maxL = min(minL, n), max(maxL, n)
		lens[n] = true
	}
	if minL != 30 || maxL != 4118 {
		t.Errorf("block lengths [%d, %d], want [30, 4118]", minL, maxL)
	}
	dec := make([]byte, z.Size())
	if n, err := z.ReadAt(dec, 0); n != len(dec) || (err != nil && err != io.EOF) {
		t.Fatalf("decompress: %d %v", n, err)
	}
	if got := sum(dec); got != "39195424aa10572fe002262190877b4306a66be9c62c8f1594141b01dc79c2ea" {
		t.Errorf("decompressed sha256 %s", got)
	}
	// LSMT.
	lh, lt := l.Header(), l.Trailer()
	if lh.Flags != 0x07 || lh.IndexOffset != 0 || lh.IndexSize != 0 {
		t.Errorf("lsmt header %+v", lh)
	}
	if lt.Flags != 0x06 || lt.IndexOffset != 71512064 || lt.IndexSize != 768 || lt.VirtualSize != 64<<30 {
		t.Errorf("lsmt trailer %+v", lt)
	}
	if lt.UUID != "01BB4FCE-3EB1-B56B-05AD-F99504DAFD31" || lt.ParentUUID != "" || lt.Version != 1 ||
		lt.SubVersion != 1 || lt.UserTag != "" {
		t.Errorf("lsmt ids %+v", lt)
	}
	ms := l.Index().Mappings()
	if len(ms) != 515 || l.PaddingEntries() != 253 {
		t.Fatalf("entries %d padding %d", len(ms), l.PaddingEntries())
	}
	var total uint64
	next := uint64(8)
	for _, m := range ms {
		total += uint64(m.Length)
		if m.MOffset != next || m.Zeroed || m.Tag != 0 {
			t.Fatalf("mapping %+v not contiguous at %d", m, next)
		}
		next = m.MEnd()
	}
	if total != 139664 || next != 139672 {
		t.Errorf("mapped %d sectors, moffset end %d", total, next)
	}
	want := []lsmt.Mapping{{Offset: 0, Length: 8448, MOffset: 8}, {Offset: 12288, Length: 256, MOffset: 8456},
		{Offset: 262144, Length: 72, MOffset: 8712}}
	for i, w := range want {
		if ms[i] != w {
			t.Errorf("entry %d = %+v, want %+v", i, ms[i], w)
		}
	}
	if last := ms[514]; last != (lsmt.Mapping{Offset: 133963776, Length: 256, MOffset: 139416}) {
		t.Errorf("last entry %+v", last)
	}
	if got := sum(dec[71512064 : 71512064+12288]); got != "d080c1886db8277f5d691dec0892c5111df1e2164b2bad3b80c9d2f84f4c39bd" {
		t.Errorf("index sha256 %s", got)
	}
}

func TestGoldenHWReads(t *testing.T) {
	l, _ := openHW(t)
	buf := make([]byte, 4<<20)
	if n, err := l.ReadAt(buf, 0); n != len(buf) || err != nil {
		t.Fatalf("read: %d %v", n, err)
	}
	if got := sum(buf); got != "1ba9757892e20ff13d4dc47e72694349129a92f41f20b65010a4082f3261466c" {
		t.Errorf("[0,4MiB) sha256 %s", got)
	}
	if buf[1080] != 0x53 || buf[1081] != 0xEF {
		t.Errorf("ext4 magic % x", buf[1080:1082])
	}
	gap := make([]byte, 6291456-4325376)
	for i := range gap {
		gap[i] = 0xAA
	}
	if _, err := l.ReadAt(gap, 4325376); err != nil || !bytes.Equal(gap, make([]byte, len(gap))) {
		t.Errorf("gap not zero: %v", err)
	}
	last := make([]byte, 131072)
	if _, err := l.ReadAt(last, 68589453312); err != nil {
		t.Fatal(err)
	}
	if got := sum(last); got != "031852c992b1e8b880c13e51589dc78a89d4f05843c457ad58d6bdb8b16d7a1e" {
		t.Errorf("last mapping sha256 %s", got)
	}
	tail := make([]byte, 8192)
	tail[0] = 1
	if n, err := l.ReadAt(tail, 64<<30-8192); n != 8192 || err != nil || !bytes.Equal(tail, make([]byte, 8192)) {
		t.Errorf("tail read %d %v", n, err)
	}
	if n, err := l.ReadAt(tail, 64<<30); n != 0 || err != io.EOF {
		t.Errorf("read at vsize: %d %v", n, err)
	}
}

// TestZFileBlockCRCs checks that every block of the vector verifies.
func TestZFileBlockCRCs(t *testing.T) {
	l, _ := openHW(t)
	if err := l.ZFile.Verify(); err != nil {
		t.Fatal(err)
	}
}

// TestRecommitByteIdentical re-commits the vector's mappings with our
// writer: the result must equal the C++-written LSMT byte for byte (index
// piece size, merge rule, padding, trailer placement, uuid text).
func TestRecommitByteIdentical(t *testing.T) {
	l, _ := openHW(t)
	tr := l.Trailer()
	h := sha256.New()
	info, err := lsmt.Commit(h, lsmt.CommitSource{
		Mappings:    l.Index().Mappings(),
		VirtualSize: tr.VirtualSize,
		Read:        func(_ uint8, p []byte, off int64) error { return l.ReadPhysical(p, off) },
	}, lsmt.CommitOptions{UUID: tr.UUID, ParentUUID: tr.ParentUUID, UserTag: tr.UserTag})
	if err != nil {
		t.Fatal(err)
	}
	if info.Size != 71528448 || info.Entries != 515 {
		t.Fatalf("commit info %+v", info)
	}
	if got := hex.EncodeToString(h.Sum(nil)); got != "39195424aa10572fe002262190877b4306a66be9c62c8f1594141b01dc79c2ea" {
		t.Fatalf("recommitted sha256 %s differs from the C++ layer", got)
	}
}

// TestRecompressByteIdentical re-compresses the decompressed vector with our
// ZFile writer (LZ4, 4 KiB, verify, header overwrite) and compares it with
// the C++-written payload.
func TestRecompressByteIdentical(t *testing.T) {
	l, raw := openHW(t)
	dec := make([]byte, l.ZFile.Size())
	if _, err := l.ZFile.ReadAt(dec, 0); err != nil && err != io.EOF {
		t.Fatal(err)
	}
	f, err := os.Create(t.TempDir() + "/z")
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	w, err := zfile.NewWriter(f, zfile.WriterOptions{Algo: zfile.AlgoLZ4})
	if err != nil {
		t.Fatal(err)
	}
	w.Write(dec)
	if err := w.Close(); err != nil {
		t.Fatal(err)
	}
	got, _ := os.ReadFile(f.Name())
	want := raw[1536 : 1536+639491]
	if !bytes.Equal(got, want) {
		i := 0
		for i < len(got) && i < len(want) && got[i] == want[i] {
			i++
		}
		t.Fatalf("re-compressed ZFile differs from the C++ payload at byte %d (sizes %d / %d)", i, len(got), len(want))
	}
}

func TestBadInputErrors(t *testing.T) {
	raw, err := os.ReadFile(hwLayer)
	if err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct {
		name string
		mut  func([]byte) []byte
		want error
	}{
		{"zfile header digest", func(b []byte) []byte { b[1536+100] ^= 1; return b }, zfile.ErrChecksum},
		{"zfile jump table", func(b []byte) []byte { b[1536+569127+3] ^= 1; return b }, zfile.ErrChecksum},
		{"truncated", func(b []byte) []byte { return b[:300000] }, nil},
		{"lsmt magic (not a layer)", func(b []byte) []byte { return bytes.Repeat([]byte{0x4c}, 20000) }, lsmt.ErrFormat},
	} {
		t.Run(tc.name, func(t *testing.T) {
			b := tc.mut(bytes.Clone(raw))
			_, err := Open(bytes.NewReader(b), int64(len(b)), "blob-under-test")
			if err == nil {
				t.Fatal("accepted")
			}
			if tc.want != nil && !errors.Is(err, tc.want) {
				t.Fatalf("error %v, want %v", err, tc.want)
			}
			if !strings.Contains(err.Error(), "blob-under-test") {
				t.Fatalf("error does not name the file: %v", err)
			}
		})
	}
	// A bit flip inside a compressed block is found on read, naming the block.
	b := bytes.Clone(raw)
	b[1536+300000] ^= 1
	l, err := Open(bytes.NewReader(b), int64(len(b)), "flipped")
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	var rerr error
	for _, m := range l.Index().Mappings() {
		p := make([]byte, int(m.Length)*512)
		if _, rerr = l.ReadAt(p, int64(m.Offset)*512); rerr != nil {
			break
		}
	}
	if !errors.Is(rerr, zfile.ErrChecksum) || !strings.Contains(rerr.Error(), "flipped") || !strings.Contains(rerr.Error(), "offset") {
		t.Fatalf("bit flip: %v", rerr)
	}
}
