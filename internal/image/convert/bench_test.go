package convert

import (
	"archive/tar"
	"context"
	"fmt"
	"path/filepath"
	"strings"
	"testing"

	"github.com/aenv-dev/aenv/internal/image"
)

// BenchmarkConvert measures pull (from an OCI layout) + conversion of one
// 32 MiB layer into a fresh cache: throughput is uncompressed layer data.
func BenchmarkConvert(b *testing.B) {
	requireRoot(b)
	const files, size = 256, 128 << 10
	var ents []ent
	for i := range files {
		ents = append(ents, ent{name: fmt.Sprintf("d%d/f%d", i%16, i), typ: tar.TypeReg,
			body: strings.Repeat(fmt.Sprintf("%08x", i*7919), size/8)})
	}
	img := pullLayout(b, layer(b, ents...))
	b.SetBytes(files * size)
	b.ResetTimer()
	for b.Loop() {
		data := b.TempDir()
		o := Options{Store: &image.Store{Dir: filepath.Join(data, "images")}, Dir: filepath.Join(data, "overlaybd"), SizeMB: 256}
		if _, err := Convert(context.Background(), img, o); err != nil {
			b.Fatal(err)
		}
	}
}
