package zfile

import (
	"bytes"
	"io"
	"testing"
)

// benchData is half compressible text, a third random, the rest zeros (see
// sample), 16 MiB.
var benchData = sample(16 << 20)

func BenchmarkCompress(b *testing.B) {
	for _, a := range []Algorithm{AlgoLZ4, AlgoZstd} {
		b.Run(a.String(), func(b *testing.B) {
			b.SetBytes(int64(len(benchData)))
			for i := 0; i < b.N; i++ {
				w, _ := NewWriter(io.Discard, WriterOptions{Algo: a})
				w.Write(benchData)
				w.Close()
			}
		})
	}
}

func BenchmarkDecompress(b *testing.B) {
	for _, a := range []Algorithm{AlgoLZ4, AlgoZstd} {
		b.Run(a.String(), func(b *testing.B) {
			var buf bytes.Buffer
			w, _ := NewWriter(&buf, WriterOptions{Algo: a})
			w.Write(benchData)
			w.Close()
			z, err := Open(bytes.NewReader(buf.Bytes()), int64(buf.Len()), "bench")
			if err != nil {
				b.Fatal(err)
			}
			out := make([]byte, 1<<20)
			b.SetBytes(int64(len(benchData)))
			b.ResetTimer()
			for i := 0; i < b.N; i++ {
				for off := int64(0); off < z.Size(); off += int64(len(out)) {
					z.ReadAt(out, off)
				}
			}
		})
	}
}
