package convert

import (
	"archive/tar"
	"context"
	"fmt"
	"io"
	"log"
	"net/http/httptest"
	"path/filepath"
	"strings"
	"testing"

	"github.com/google/go-containerregistry/pkg/name"
	"github.com/google/go-containerregistry/pkg/registry"
	v1 "github.com/google/go-containerregistry/pkg/v1"
	"github.com/google/go-containerregistry/pkg/v1/empty"
	"github.com/google/go-containerregistry/pkg/v1/mutate"
	"github.com/google/go-containerregistry/pkg/v1/remote"
	"github.com/google/go-containerregistry/pkg/v1/types"

	"github.com/aenv-dev/aenv/internal/image"
)

// BenchmarkPullConvertRegistry measures what `aenv pull --convert` does for an image
// none of whose layers the node has: resolve it on a loopback registry, download its
// three layers (64 MiB uncompressed in all, gzipped) into a fresh blob cache, and
// convert each into a sealed ZFile layer. Throughput is uncompressed layer data.
func BenchmarkPullConvertRegistry(b *testing.B) {
	requireRoot(b)
	var layers []v1.Layer
	var total int64
	for n, files := range []int{128, 128, 256} { // 16, 16 and 32 MiB
		const size = 128 << 10
		var ents []ent
		for i := range files {
			// Text that compresses about as well as binaries and libraries do (2-3x).
			ents = append(ents, ent{name: fmt.Sprintf("l%d/d%d/f%d", n, i%16, i), typ: tar.TypeReg,
				body: strings.Repeat(fmt.Sprintf("%08x layer %d file %d\n", i*7919+n, n, i), size/16)[:size]})
		}
		layers = append(layers, layer(b, ents...))
		total += int64(files) * size
	}
	img, err := mutate.AppendLayers(empty.Image, layers...)
	if err != nil {
		b.Fatal(err)
	}
	cf, _ := img.ConfigFile()
	cf = cf.DeepCopy()
	cf.OS, cf.Architecture = image.HostPlatform().OS, image.HostPlatform().Architecture
	img, _ = mutate.ConfigFile(mutate.MediaType(img, types.OCIManifestSchema1), cf)
	srv := httptest.NewServer(registry.New(registry.Logger(log.New(io.Discard, "", 0))))
	b.Cleanup(srv.Close)
	ref := strings.TrimPrefix(srv.URL, "http://") + "/bench:1"
	r, err := name.ParseReference(ref)
	if err != nil {
		b.Fatal(err)
	}
	if err := remote.Write(r, img); err != nil {
		b.Fatal(err)
	}
	b.SetBytes(total)
	ctx := context.Background()
	b.ResetTimer()
	for b.Loop() {
		data := b.TempDir()
		pulled, err := image.Pull(ctx, ref, image.Options{})
		if err != nil {
			b.Fatal(err)
		}
		o := Options{Store: &image.Store{Dir: filepath.Join(data, "images")}, Dir: filepath.Join(data, "overlaybd"), SizeMB: 256}
		res, err := Convert(ctx, pulled, o)
		pulled.Close()
		if err != nil {
			b.Fatal(err)
		}
		// Plus the empty ext4 the first layer starts from.
		if res.Converted != len(layers)+1 {
			b.Fatalf("converted %d layers, want %d: the cache was not fresh", res.Converted, len(layers)+1)
		}
	}
}
