package repository

import (
	"bytes"
	"errors"
	"testing"
)

func TestBlockHashesRoundTrip(t *testing.T) {
	for _, tc := range []struct {
		size, chunk int64
		sums        int
	}{
		{0, 1 << 20, 0},
		{1, 4096, 1},
		{4096, 4096, 1},
		{4097, 4096, 2},
		{3<<20 + 5, 1 << 20, 4},
	} {
		data := bytes.Repeat([]byte{7}, int(tc.size))
		h, err := ComputeBlockHashes(bytes.NewReader(data), tc.chunk)
		if err != nil {
			t.Fatal(err)
		}
		if h.Size != tc.size || len(h.Sums) != tc.sums {
			t.Fatalf("size %d chunk %d: got size %d, %d sums", tc.size, tc.chunk, h.Size, len(h.Sums))
		}
		back, err := DecodeBlockHashes(h.Encode())
		if err != nil || back.Digest() != h.Digest() {
			t.Fatalf("round trip: %v", err)
		}
	}
	for _, chunk := range []int64{0, 1000, 2048, 128 << 20} {
		if _, err := ComputeBlockHashes(bytes.NewReader(nil), chunk); !errors.Is(err, ErrInvalid) {
			t.Errorf("chunk %d: %v", chunk, err)
		}
	}
}

func TestDecodeBlockHashesRejects(t *testing.T) {
	good, _ := ComputeBlockHashes(bytes.NewReader(make([]byte, 10000)), 4096)
	enc := good.Encode()
	for name, b := range map[string][]byte{
		"empty":       nil,
		"bad magic":   append([]byte("aenvbh02"), enc[8:]...),
		"short sums":  enc[:len(enc)-1],
		"extra sums":  append(bytes.Clone(enc), make([]byte, 32)...),
		"odd chunk":   func() []byte { b := bytes.Clone(enc); b[16] = 1; return b }(),
		"huge size":   func() []byte { b := bytes.Clone(enc); b[15] = 0x7f; return b }(),
		"header only": enc[:24],
	} {
		if _, err := DecodeBlockHashes(b); !errors.Is(err, ErrInvalid) {
			t.Errorf("%s: %v, want ErrInvalid", name, err)
		}
	}
}

func TestRecordBlobDigestsIncludeHashLists(t *testing.T) {
	l := Layer{Role: "rootfs", Digest: DigestOf([]byte("a")), Size: 1, BlockHashes: DigestOf([]byte("b"))}
	r := Record{Version: 1, Kind: KindSnapshot, ID: "s", State: StateComplete, Layers: []Layer{l, {Role: "rootfs", Digest: DigestOf([]byte("c"))}}}
	if err := r.Validate(); err != nil {
		t.Fatal(err)
	}
	if got := r.BlobDigests(); len(got) != 3 || got[2] != l.BlockHashes {
		t.Fatalf("BlobDigests = %v", got)
	}
	r.Layers[0].BlockHashes = "sha256:zz"
	if err := r.Validate(); !errors.Is(err, ErrInvalid) {
		t.Fatalf("bad block hashes digest: %v", err)
	}
}

// FuzzDecodeBlockHashes: any input either decodes to a list that encodes
// back to the same bytes, or fails with ErrInvalid; never a panic.
func FuzzDecodeBlockHashes(f *testing.F) {
	h, _ := ComputeBlockHashes(bytes.NewReader(make([]byte, 9000)), 4096)
	f.Add(h.Encode())
	f.Add([]byte("aenvbh01"))
	f.Add(h.Encode()[:40])
	f.Fuzz(func(t *testing.T, b []byte) {
		h, err := DecodeBlockHashes(b)
		if err != nil {
			if !errors.Is(err, ErrInvalid) {
				t.Fatalf("error not ErrInvalid: %v", err)
			}
			return
		}
		if !bytes.Equal(h.Encode(), b) {
			t.Fatal("decode/encode does not round-trip")
		}
	})
}
