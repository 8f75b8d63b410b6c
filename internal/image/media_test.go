package image

import (
	"bytes"
	"context"
	"io"
	"os"
	"path/filepath"
	"runtime"
	"testing"

	"github.com/google/go-containerregistry/pkg/compression"
	"github.com/google/go-containerregistry/pkg/v1/empty"
	"github.com/google/go-containerregistry/pkg/v1/mutate"
	"github.com/google/go-containerregistry/pkg/v1/static"
	"github.com/google/go-containerregistry/pkg/v1/tarball"
	"github.com/google/go-containerregistry/pkg/v1/types"
)

// TestLayerEncodings pulls an image whose layers are gzip, zstd and
// uncompressed tars, and checks every file and the progress reports.
func TestLayerEncodings(t *testing.T) {
	requireRoot(t)
	opener := func(b []byte) tarball.Opener {
		return func() (io.ReadCloser, error) { return io.NopCloser(bytes.NewReader(b)), nil }
	}
	gz, err := tarball.LayerFromOpener(opener(tarOf(t, ent{name: "gz", body: "g"})), tarball.WithMediaType(types.OCILayer))
	if err != nil {
		t.Fatal(err)
	}
	zs, err := tarball.LayerFromOpener(opener(tarOf(t, ent{name: "zstd", body: "z"})),
		tarball.WithCompression(compression.ZStd), tarball.WithMediaType(types.OCILayerZStd))
	if err != nil {
		t.Fatal(err)
	}
	raw := static.NewLayer(tarOf(t, ent{name: "raw", body: "r"}, ent{name: "bin/sh", body: "#!", mode: 0o755},
		ent{name: "etc/passwd", body: "root:x:0:0::/root:/bin/sh\n"}), types.OCIUncompressedLayer)
	img, err := mutate.AppendLayers(empty.Image, gz, zs, raw)
	if err != nil {
		t.Fatal(err)
	}
	host := serveRegistry(t, nil)
	push(t, host+"/enc:1", withConfig(t, img, runtime.GOARCH))
	ctx := context.Background()
	pulled, err := Pull(ctx, host+"/enc:1", Options{})
	if err != nil {
		t.Fatal(err)
	}
	var reports []Progress
	dir := filepath.Join(t.TempDir(), "tpl")
	b, err := BuildTemplate(ctx, pulled, dir, BuildOptions{Store: &Store{Dir: t.TempDir()}, Progress: func(p Progress) { reports = append(reports, p) }})
	if err != nil {
		t.Fatal(err)
	}
	for name, want := range map[string]string{"gz": "g", "zstd": "z", "raw": "r"} {
		if got, err := os.ReadFile(filepath.Join(b.RootFS, name)); err != nil || string(got) != want {
			t.Errorf("%s = %q, %v", name, got, err)
		}
	}
	finals := map[Phase]int{}
	for _, r := range reports {
		if r.Final {
			finals[r.Phase]++
			if r.Layers != 3 || r.Done != r.Total || r.Total == 0 {
				t.Errorf("report %+v", r)
			}
		}
	}
	if finals[PhaseDownload] != 3 || finals[PhaseApply] != 3 {
		t.Errorf("final reports per phase = %v", finals)
	}
	if b.Bytes == 0 {
		t.Error("no bytes counted")
	}
}

// BenchmarkPullBuild pulls a 32 MiB (uncompressed) two-layer image from the
// in-process registry and unpacks it into a template, with a cold cache;
// throughput is uncompressed layer bytes.
func BenchmarkPullBuild(b *testing.B) {
	requireRoot(b)
	var ents []ent
	for i := range 256 {
		ents = append(ents, ent{name: "d/f" + string(rune('a'+i%26)) + string(rune('a'+i/26)), body: string(bytes.Repeat([]byte{byte(i)}, 128<<10))})
	}
	l := tarOf(b, ents...)
	img, _ := mutate.AppendLayers(empty.Image, layerOf(b, l))
	host := serveRegistry(b, nil)
	push(b, host+"/bench:1", withConfig(b, img, runtime.GOARCH))
	b.SetBytes(int64(len(l)))
	ctx := context.Background()
	for b.Loop() {
		pulled, err := Pull(ctx, host+"/bench:1", Options{})
		if err != nil {
			b.Fatal(err)
		}
		if _, err := BuildTemplate(ctx, pulled, filepath.Join(b.TempDir(), "tpl"), BuildOptions{Store: &Store{Dir: b.TempDir()}}); err != nil {
			b.Fatal(err)
		}
	}
}
