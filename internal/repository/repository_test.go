package repository

import (
	"bytes"
	"encoding/json"
	"errors"
	"io"
	"strings"
	"testing"
	"testing/iotest"
	"time"
)

func TestParseDigest(t *testing.T) {
	good := DigestOf([]byte("x"))
	for _, tc := range []struct {
		in string
		ok bool
	}{
		{string(good), true},
		{"sha256:" + strings.Repeat("0", 64), true},
		{"", false},
		{"sha256:", false},
		{"sha512:" + strings.Repeat("0", 64), false},
		{"sha256:" + strings.Repeat("0", 63), false},
		{"sha256:" + strings.Repeat("A", 64), false},
		{"sha256:" + strings.Repeat("g", 64), false},
		{"sha256:../" + strings.Repeat("0", 61), false},
		{strings.Repeat("0", 64), false},
	} {
		_, err := ParseDigest(tc.in)
		if (err == nil) != tc.ok || (err != nil && !errors.Is(err, ErrInvalid)) {
			t.Errorf("ParseDigest(%q) = %v, want ok=%v", tc.in, err, tc.ok)
		}
	}
	if good.Hex() != string(good)[7:] {
		t.Fatal("Hex")
	}
}

func TestVerifyingReader(t *testing.T) {
	data := bytes.Repeat([]byte("abcdefgh"), 5000)
	d := DigestOf(data)
	bad := bytes.Clone(data)
	bad[len(bad)-1] = 'X'
	for _, tc := range []struct {
		name string
		r    io.Reader
		size int64
		ok   bool
	}{
		{"match known size", bytes.NewReader(data), int64(len(data)), true},
		{"match unknown size", bytes.NewReader(data), -1, true},
		{"match one byte at a time", iotest.OneByteReader(bytes.NewReader(data)), int64(len(data)), true},
		{"match with data and EOF together", iotest.DataErrReader(bytes.NewReader(data)), -1, true},
		{"last byte differs", bytes.NewReader(bad), int64(len(data)), false},
		{"last byte differs unknown size", bytes.NewReader(bad), -1, false},
		{"truncated", bytes.NewReader(data[:100]), int64(len(data)), false},
		{"extra byte", io.MultiReader(bytes.NewReader(data), strings.NewReader("!")), int64(len(data)), false},
		{"declared too small", bytes.NewReader(data), int64(len(data)) - 1, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			got, err := io.ReadAll(VerifyingReader(tc.r, NewVerifier(d, tc.size)))
			if tc.ok {
				if err != nil || !bytes.Equal(got, data) {
					t.Fatalf("err %v, %d bytes", err, len(got))
				}
				return
			}
			if !errors.Is(err, ErrDigestMismatch) {
				t.Fatalf("err = %v, want ErrDigestMismatch", err)
			}
			// With a declared size the reader must not hand out the last
			// byte of bad content: an uploader would complete the object.
			if tc.size >= 0 && int64(len(got)) >= tc.size {
				t.Fatalf("delivered all %d declared bytes of bad content", len(got))
			}
		})
	}
}

func validRecord() Record {
	return Record{
		Version: RecordVersion, Kind: KindSnapshot, ID: "snap-1", State: StatePending,
		Layers:    []Layer{{Role: "rootfs", Digest: DigestOf([]byte("l")), Size: 1}},
		Config:    json.RawMessage(`{"a":1}`),
		CreatedAt: time.Unix(1, 0).UTC(), UpdatedAt: time.Unix(2, 0).UTC(),
	}
}

func TestRecordValidate(t *testing.T) {
	for _, tc := range []struct {
		name   string
		mutate func(*Record)
	}{
		{"version 0", func(r *Record) { r.Version = 0 }},
		{"future version", func(r *Record) { r.Version = RecordVersion + 1 }},
		{"unknown kind", func(r *Record) { r.Kind = "volume" }},
		{"empty id", func(r *Record) { r.ID = "" }},
		{"path id", func(r *Record) { r.ID = "a/../b" }},
		{"dot id", func(r *Record) { r.ID = ".." }},
		{"bad name", func(r *Record) { r.Name = "has space" }},
		{"bad state", func(r *Record) { r.State = "" }},
		{"negative revision", func(r *Record) { r.Revision = -1 }},
		{"bad digest", func(r *Record) { r.Layers[0].Digest = "sha256:1" }},
		{"negative layer size", func(r *Record) { r.Layers[0].Size = -5 }},
		{"empty role", func(r *Record) { r.Layers[0].Role = "" }},
		{"negative memory", func(r *Record) { r.Resources.MemoryMB = -1 }},
		{"bad source sandbox", func(r *Record) { r.SourceSandboxID = "x/y" }},
		{"bad config", func(r *Record) { r.Config = json.RawMessage("{") }},
	} {
		t.Run(tc.name, func(t *testing.T) {
			r := validRecord()
			tc.mutate(&r)
			if err := r.Validate(); !errors.Is(err, ErrInvalid) {
				t.Fatalf("Validate = %v, want ErrInvalid", err)
			}
			if _, err := EncodeRecord(r); !errors.Is(err, ErrInvalid) {
				t.Fatalf("EncodeRecord = %v, want ErrInvalid", err)
			}
		})
	}
	if err := validRecord().Validate(); err != nil {
		t.Fatal(err)
	}
}

func TestDecodeRecord(t *testing.T) {
	b, err := EncodeRecord(validRecord())
	if err != nil {
		t.Fatal(err)
	}
	r, err := DecodeRecord(b)
	if err != nil {
		t.Fatal(err)
	}
	if b2, _ := EncodeRecord(r); !bytes.Equal(b, b2) {
		t.Fatalf("round trip differs:\n%s\n%s", b, b2)
	}
	withUnknown := bytes.Replace(b, []byte(`"version"`), []byte(`"future_field": [1,2], "version"`), 1)
	if _, err := DecodeRecord(withUnknown); err != nil {
		t.Fatalf("unknown field: %v", err)
	}
	for name, in := range map[string]string{
		"empty":    "",
		"not json": "hello",
		"array":    "[]",
		"trailing": string(b) + "{}",
		"huge":     `{"id":"` + strings.Repeat("a", maxRecordBytes) + `"}`,
		"wrong id": strings.Replace(string(b), `"snap-1"`, `"../x"`, 1),
	} {
		if _, err := DecodeRecord([]byte(in)); !errors.Is(err, ErrInvalid) {
			t.Errorf("%s: err = %v, want ErrInvalid", name, err)
		}
	}
}

func TestPrepareRecord(t *testing.T) {
	now := time.Date(2026, 1, 2, 3, 4, 5, 6e6, time.UTC)
	rec := validRecord()
	rec.Version = 0 // defaulted
	created, err := PrepareRecord(rec, nil, now)
	if err != nil || created.Revision != 1 || !created.UpdatedAt.Equal(now) || created.Version != RecordVersion {
		t.Fatalf("create = %+v, %v", created, err)
	}
	for _, tc := range []struct {
		name   string
		rev    int64
		stored *Record
		want   error
	}{
		{"create over existing", 0, &created, ErrExists},
		{"update missing", 1, nil, ErrNotFound},
		{"stale update", 2, &created, ErrConflict},
	} {
		r := created
		r.Revision = tc.rev
		if _, err := PrepareRecord(r, tc.stored, now); !errors.Is(err, tc.want) {
			t.Errorf("%s: %v, want %v", tc.name, err, tc.want)
		}
	}
	later := now.Add(time.Hour)
	upd, err := PrepareRecord(created, &created, later)
	if err != nil || upd.Revision != 2 || !upd.CreatedAt.Equal(created.CreatedAt) || !upd.UpdatedAt.Equal(later) {
		t.Fatalf("update = %+v, %v", upd, err)
	}
}

func TestFilterIDs(t *testing.T) {
	ids := []string{"a", "a-b", "a.b", "b", "ba", "c"}
	for _, tc := range []struct {
		o        ListOptions
		want     string
		wantNext string
	}{
		{ListOptions{Limit: 2}, "a a-b", "a-b"},
		{ListOptions{Limit: 2, After: "a-b"}, "a.b b", "b"},
		{ListOptions{Limit: 2, After: "b"}, "ba c", ""},
		{ListOptions{Limit: 10, Prefix: "a"}, "a a-b a.b", ""},
		{ListOptions{Limit: 1, Prefix: "b", After: "b"}, "ba", ""},
		{ListOptions{Limit: 5, After: "zzz"}, "", ""},
	} {
		got, next := FilterIDs(ids, tc.o)
		if strings.Join(got, " ") != tc.want || next != tc.wantNext {
			t.Errorf("FilterIDs(%+v) = %v, %q; want %q, %q", tc.o, got, next, tc.want, tc.wantNext)
		}
	}
}

// FuzzDecodeRecord: any input is either rejected with ErrInvalid or decodes
// to a record that re-encodes and decodes to the same bytes.
func FuzzDecodeRecord(f *testing.F) {
	b, _ := EncodeRecord(validRecord())
	f.Add(b)
	f.Add([]byte(`{"version":1,"kind":"template","id":"t","state":"complete","revision":3,"resources":{}}`))
	f.Add([]byte(`{"version":1,"kind":"template","id":"t","state":"complete","layers":[{"role":"rootfs","digest":"sha256:zz","size":1}]}`))
	f.Add([]byte(`null`))
	f.Fuzz(func(t *testing.T, in []byte) {
		r, err := DecodeRecord(in)
		if err != nil {
			if !errors.Is(err, ErrInvalid) {
				t.Fatalf("error not ErrInvalid: %v", err)
			}
			return
		}
		enc, err := EncodeRecord(r)
		if err != nil {
			t.Fatalf("decoded record does not encode: %v", err)
		}
		r2, err := DecodeRecord(enc)
		if err != nil {
			t.Fatalf("re-decode: %v", err)
		}
		enc2, _ := EncodeRecord(r2)
		if !bytes.Equal(enc, enc2) {
			t.Fatalf("unstable encoding:\n%s\n%s", enc, enc2)
		}
	})
}
