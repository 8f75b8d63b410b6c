package unpack

import (
	"archive/tar"
	"bytes"
	"context"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"
)

// BenchmarkApply applies a layer of 2048 files (16 KiB each, 32 MiB) in 64
// directories; throughput is tar bytes.
func BenchmarkApply(b *testing.B) {
	var ents []ent
	for i := range 64 {
		ents = append(ents, ent{name: fmt.Sprintf("d%d/", i), typ: tar.TypeDir})
	}
	for i := range 2048 {
		ents = append(ents, ent{name: fmt.Sprintf("d%d/sub/f%d", i%64, i), body: strings.Repeat("x", 16<<10)})
	}
	layer := mkTar(b, ents...)
	b.SetBytes(int64(len(layer)))
	dir := b.TempDir()
	b.ResetTimer()
	n := 0
	for b.Loop() {
		root := filepath.Join(dir, fmt.Sprint(n))
		n++
		os.Mkdir(root, 0o755)
		if _, err := Apply(context.Background(), root, bytes.NewReader(layer), Options{}); err != nil {
			b.Fatal(err)
		}
		b.StopTimer()
		os.RemoveAll(root)
		b.StartTimer()
	}
}
