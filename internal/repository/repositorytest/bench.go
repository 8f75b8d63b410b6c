package repositorytest

import (
	"bytes"
	"context"
	"encoding/binary"
	"io"
	"testing"

	"github.com/aenv-dev/aenv/internal/repository"
)

// BenchPut measures publishing new (never deduplicated) blobs of size bytes,
// digest verification included; each blob is deleted untimed afterwards.
func BenchPut(b *testing.B, r repository.Repository, size int) {
	ctx := context.Background()
	data, _ := Blob(uint64(size), size)
	b.SetBytes(int64(size))
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		b.StopTimer()
		binary.LittleEndian.PutUint64(data, uint64(i)+1<<40)
		d := repository.DigestOf(data)
		b.StartTimer()
		if _, err := r.PutBlob(ctx, d, int64(size), bytes.NewReader(data)); err != nil {
			b.Fatal(err)
		}
		b.StopTimer()
		if err := r.DeleteBlob(ctx, d); err != nil {
			b.Fatal(err)
		}
		b.StartTimer()
	}
}

// BenchGet measures reading a whole blob of size bytes, digest check included.
func BenchGet(b *testing.B, r repository.Repository, size int) {
	ctx := context.Background()
	data, d := Blob(uint64(size)+1, size)
	if _, err := r.PutBlob(ctx, d, int64(size), bytes.NewReader(data)); err != nil {
		b.Fatal(err)
	}
	b.SetBytes(int64(size))
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		rc, err := r.GetBlob(ctx, d)
		if err != nil {
			b.Fatal(err)
		}
		if n, err := io.Copy(io.Discard, rc); err != nil || n != int64(size) {
			b.Fatalf("read %d bytes: %v", n, err)
		}
		rc.Close()
	}
}

// BenchReadAt measures lazy 1 MiB ranged reads spread over a blob of size
// bytes, as a sealed layer's block cache issues them.
func BenchReadAt(b *testing.B, r repository.Repository, size int) {
	ctx := context.Background()
	data, d := Blob(uint64(size)+2, size)
	if _, err := r.PutBlob(ctx, d, int64(size), bytes.NewReader(data)); err != nil {
		b.Fatal(err)
	}
	br, err := r.OpenBlob(ctx, d)
	if err != nil {
		b.Fatal(err)
	}
	defer br.Close()
	const chunk = 1 << 20
	p := make([]byte, chunk)
	blocks := int64(size / chunk)
	b.SetBytes(chunk)
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		off := (int64(i) * 7919 % blocks) * chunk
		if _, err := br.ReadAt(ctx, p, off); err != nil {
			b.Fatal(err)
		}
	}
}
