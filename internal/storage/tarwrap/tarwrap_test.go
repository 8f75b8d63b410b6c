package tarwrap

import (
	"archive/tar"
	"bytes"
	"os"
	"testing"
)

func hwHead(t testing.TB) []byte {
	b, err := os.ReadFile("../blob/testdata/hw_layer.bin")
	if err != nil {
		t.Fatal(err)
	}
	return b
}

func TestDetect(t *testing.T) {
	hw := hwHead(t)
	var std bytes.Buffer
	tw := tar.NewWriter(&std)
	tw.WriteHeader(&tar.Header{Name: "overlaybd.commit", Mode: 0o644, Size: 5, Typeflag: tar.TypeReg})
	tw.Write([]byte("hello"))
	tw.Close()
	tests := []struct {
		name    string
		in      []byte
		wantOff int64
		wantLen int64
		wantErr bool
		notTar  bool
	}{
		{"overlaybd pax", hw, 1536, 639491, false, false},
		{"go archive/tar", std.Bytes(), 512, 5, false, false},
		{"raw", bytes.Repeat([]byte{0}, 4096), 0, 0, false, true},
		{"short", []byte("ustar"), 0, 0, false, true},
		{"lying pax size", func() []byte { b := bytes.Clone(hw); copy(b[512:], "15 size=999991\n"); return b }(), 0, 0, true, false},
		{"bad checksum", func() []byte { b := bytes.Clone(hw); b[0] = 'X'; return b }(), 0, 0, false, true},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			info, err := Detect(bytes.NewReader(tc.in), int64(len(tc.in)))
			if (err != nil) != tc.wantErr {
				t.Fatalf("err %v", err)
			}
			if tc.wantErr {
				return
			}
			if (info == nil) != tc.notTar {
				t.Fatalf("info %+v", info)
			}
			if info != nil && (info.PayloadOffset != tc.wantOff || info.PayloadSize != tc.wantLen) {
				t.Fatalf("info %+v", info)
			}
		})
	}
}

func FuzzDetect(f *testing.F) {
	hw := hwHead(f)[:4096]
	f.Add(hw)
	for _, pos := range []int{124, 130, 148, 156, 257, 512, 516, 1024 + 124} {
		m := bytes.Clone(hw)
		m[pos] ^= 0x07
		f.Add(m)
	}
	f.Fuzz(func(t *testing.T, b []byte) {
		info, err := Detect(bytes.NewReader(b), int64(len(b)))
		if err == nil && info != nil && (info.PayloadOffset+info.PayloadSize > int64(len(b)) || info.PayloadSize < 0) {
			t.Fatalf("payload outside blob: %+v", info)
		}
	})
}

// TestWrapByteIdentical re-wraps the vector's payload: the result must equal
// the C++-written blob.
func TestWrapByteIdentical(t *testing.T) {
	hw := hwHead(t)
	payload := hw[1536 : 1536+639491]
	var out bytes.Buffer
	if err := Wrap(&out, bytes.NewReader(payload), int64(len(payload))); err != nil {
		t.Fatal(err)
	}
	if int64(out.Len()) != WrappedSize(int64(len(payload))) {
		t.Fatalf("WrappedSize %d, wrote %d", WrappedSize(int64(len(payload))), out.Len())
	}
	if got := out.Bytes(); !bytes.Equal(got, hw) {
		i := 0
		for i < len(got) && i < len(hw) && got[i] == hw[i] {
			i++
		}
		t.Fatalf("differs at byte %d (sizes %d / %d)", i, len(got), len(hw))
	}
	if err := Wrap(&out, bytes.NewReader(payload), 5); err == nil {
		t.Fatal("size mismatch accepted")
	}
}
