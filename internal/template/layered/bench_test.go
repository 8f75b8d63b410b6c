package layered

import (
	"context"
	"encoding/json"
	"os"
	"path/filepath"
	"strconv"
	"testing"

	"github.com/aenv-dev/aenv/internal/template/base"
)

// benchBase builds the real base rootfs once per benchmark.
func benchBase(b *testing.B) string {
	b.Helper()
	for _, p := range []string{"/bin/busybox", "/bin/bash-static"} {
		if _, err := os.Stat(p); err != nil {
			b.Skipf("needs %s", p)
		}
	}
	needMkfs(b)
	dir := filepath.Join(b.TempDir(), "rootfs")
	if err := base.Build(context.Background(), base.Options{Out: dir}); err != nil {
		b.Fatal(err)
	}
	return dir
}

// BenchmarkBuildBase is what a node's first start spends making the layered base, at the
// default disk size (layer bytes reported per op).
func BenchmarkBuildBase(b *testing.B) {
	dir := benchBase(b)
	for _, sizeMB := range []int{256, 2048} {
		b.Run(strconv.Itoa(sizeMB)+"MiB", func(b *testing.B) {
			var size int64
			for i := 0; b.Loop(); i++ {
				res, err := Build(context.Background(), dir, filepath.Join(b.TempDir(), strconv.Itoa(i)), sizeMB)
				if err != nil {
					b.Fatal(err)
				}
				var a Artifact
				if err := json.Unmarshal(res.Artifact, &a); err != nil {
					b.Fatal(err)
				}
				size = a.Overlaybd.Layers[0].Size
			}
			b.ReportMetric(float64(size), "layer-bytes")
		})
	}
}

// BenchmarkBuildBaseReuse is what every later start spends: hashing the tree and finding
// the finished layer.
func BenchmarkBuildBaseReuse(b *testing.B) {
	dir := benchBase(b)
	out := filepath.Join(b.TempDir(), "layered")
	if _, err := Build(context.Background(), dir, out, 2048); err != nil {
		b.Fatal(err)
	}
	for b.Loop() {
		res, err := Build(context.Background(), dir, out, 2048)
		if err != nil || res.Built {
			b.Fatalf("built=%v err=%v", res != nil && res.Built, err)
		}
	}
}
