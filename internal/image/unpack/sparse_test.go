package unpack

import (
	"archive/tar"
	"bytes"
	"context"
	"errors"
	"io"
	"os"
	"path/filepath"
	"syscall"
	"testing"
)

// zeroReader yields n zero bytes without holding them in memory.
type zeroReader struct{ n int64 }

func (z *zeroReader) Read(p []byte) (int, error) {
	if z.n <= 0 {
		return 0, io.EOF
	}
	m := int64(len(p))
	if m > z.n {
		m = z.n
	}
	clear(p[:m])
	z.n -= m
	return int(m), nil
}

// TestApplyHugeZeroFile applies a layer holding an 8 GiB file of zeros (what a tar
// reader makes of a sparse file's holes; gzipped, a few megabytes): it must land as a
// hole, its size right and almost nothing allocated, or a small layer fills the disk.
func TestApplyHugeZeroFile(t *testing.T) {
	if testing.Short() {
		t.Skip("streams 8 GiB through the tar reader")
	}
	const size = 8 << 30
	pr, pw := io.Pipe()
	go func() {
		tw := tar.NewWriter(pw)
		err := tw.WriteHeader(&tar.Header{Name: "huge", Mode: 0o644, Size: size, Typeflag: tar.TypeReg})
		if err == nil {
			_, err = io.Copy(tw, &zeroReader{n: size - 5})
		}
		if err == nil {
			_, err = tw.Write([]byte("tail\n"))
		}
		if err == nil {
			err = tw.Close()
		}
		pw.CloseWithError(err)
	}()
	root := t.TempDir()
	st, err := Apply(context.Background(), root, pr, Options{})
	pr.Close()
	if err != nil {
		t.Fatal(err)
	}
	fi, err := os.Stat(filepath.Join(root, "huge"))
	if err != nil {
		t.Fatal(err)
	}
	if fi.Size() != size || st.Bytes != size {
		t.Errorf("size %d (stats %d), want %d", fi.Size(), st.Bytes, int64(size))
	}
	if used := fi.Sys().(*syscall.Stat_t).Blocks * 512; used > 1<<20 {
		t.Errorf("a file of zeros allocated %d bytes", used)
	}
	f, _ := os.Open(filepath.Join(root, "huge"))
	defer f.Close()
	tail := make([]byte, 5)
	if _, err := f.ReadAt(tail, size-5); err != nil || string(tail) != "tail\n" {
		t.Errorf("tail = %q, %v", tail, err)
	}
}

func TestCopySparse(t *testing.T) {
	chunk := sparseChunk
	data := func(parts ...[]byte) []byte { return bytes.Join(parts, nil) }
	zeros := func(n int) []byte { return make([]byte, n) }
	ones := func(n int) []byte { return bytes.Repeat([]byte{1}, n) }
	tests := map[string][]byte{
		"empty":             nil,
		"small data":        []byte("hello"),
		"small zeros":       zeros(100),
		"zeros then data":   data(zeros(3*chunk), ones(10)),
		"data then zeros":   data(ones(chunk+1), zeros(2*chunk+7)),
		"holes in between":  data(ones(5), zeros(chunk*4), ones(chunk), zeros(chunk), []byte("x")),
		"chunk of all ones": ones(chunk),
	}
	for name, in := range tests {
		t.Run(name, func(t *testing.T) {
			f, err := os.Create(filepath.Join(t.TempDir(), "f"))
			if err != nil {
				t.Fatal(err)
			}
			defer f.Close()
			n, err := copySparse(f, bytes.NewReader(in), make([]byte, sparseChunk), nil)
			if err != nil || n != int64(len(in)) {
				t.Fatalf("copySparse = %d, %v; want %d", n, err, len(in))
			}
			got, err := os.ReadFile(f.Name())
			if err != nil || !bytes.Equal(got, in) {
				t.Errorf("content differs (%d bytes read, %d written): %v", len(got), len(in), err)
			}
		})
	}
	// A truncated entry is an error, not a short file.
	f, _ := os.Create(filepath.Join(t.TempDir(), "f"))
	defer f.Close()
	if _, err := copySparse(f, io.MultiReader(bytes.NewReader(ones(10)), errReader{io.ErrUnexpectedEOF}), make([]byte, sparseChunk), nil); !errors.Is(err, io.ErrUnexpectedEOF) {
		t.Errorf("truncated: err = %v", err)
	}
}

type errReader struct{ err error }

func (e errReader) Read([]byte) (int, error) { return 0, e.err }

// TestApplyMinFree applies layers onto a 96 MiB tmpfs that must keep 16 MiB free: a
// layer of dense data that would eat into that fails with ErrNoSpace, while a small one
// and a huge file of zeros (holes) go through.
func TestApplyMinFree(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("needs root to mount a tmpfs")
	}
	root := t.TempDir()
	if err := syscall.Mount("tmpfs", root, "tmpfs", 0, "size=96m"); err != nil {
		t.Skipf("mount tmpfs: %v", err)
	}
	t.Cleanup(func() { syscall.Unmount(root, syscall.MNT_DETACH) })
	dense := func(n int) []byte {
		b := make([]byte, n)
		for i := range b {
			b[i] = byte(i*7 + 1)
		}
		return b
	}
	layer := func(name string, body []byte) io.Reader {
		var buf bytes.Buffer
		tw := tar.NewWriter(&buf)
		tw.WriteHeader(&tar.Header{Name: name, Mode: 0o644, Size: int64(len(body)), Typeflag: tar.TypeReg})
		tw.Write(body)
		tw.Close()
		return &buf
	}
	o := Options{MinFree: 16 << 20}
	ctx := context.Background()
	if _, err := Apply(ctx, root, layer("small", dense(4<<20)), o); err != nil {
		t.Fatalf("small layer: %v", err)
	}
	if _, err := Apply(ctx, root, layer("zeros", make([]byte, 256<<20)), o); err != nil {
		t.Fatalf("a file of zeros larger than the disk: %v", err)
	}
	_, err := Apply(ctx, root, layer("big", dense(80<<20)), o)
	if !errors.Is(err, ErrNoSpace) {
		t.Fatalf("dense layer: err = %v, want ErrNoSpace", err)
	}
	var st syscall.Statfs_t
	syscall.Statfs(root, &st)
	if free := int64(st.Bavail) * st.Bsize; free < 16<<20 {
		t.Errorf("only %d MiB left free", free>>20)
	}
}
