package node

import (
	"bytes"
	"context"
	"io"
	"log/slog"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"

	"github.com/aenv-dev/aenv/internal/config"
	"github.com/aenv-dev/aenv/internal/repository/repositorytest"
	"github.com/aenv-dev/aenv/internal/storage/stack"
)

func TestKeepAliveEvery(t *testing.T) {
	for _, tc := range []struct {
		grace, want time.Duration
	}{
		{0, 225 * time.Second}, // repository.DefaultGrace (15m) / 4
		{-time.Second, 225 * time.Second},
		{30 * time.Second, 10 * time.Second},
		{2 * time.Minute, 30 * time.Second},
		{24 * time.Hour, 5 * time.Minute},
	} {
		if got := keepAliveEvery(tc.grace); got != tc.want {
			t.Errorf("keepAliveEvery(%s) = %s, want %s", tc.grace, got, tc.want)
		}
	}
}

// openRepository wires the block cache and the lazy resolver over the configured
// repository: a blob published to the repository (and not held by the node cache) is
// read in ranges through the block cache, and the bytes fetched show on the metrics.
func TestOpenRepositoryLazyPath(t *testing.T) {
	ctx := context.Background()
	cfg := config.Default()
	cfg.DataDir = t.TempDir()
	reg := prometheus.NewRegistry()
	r, err := openRepository(ctx, cfg, reg, slog.New(slog.NewTextHandler(io.Discard, nil)))
	if err != nil {
		t.Fatal(err)
	}
	defer r.Close()
	if got := r.blocks.Stats(); got.UsedBytes != 0 {
		t.Fatalf("fresh block cache holds %d bytes", got.UsedBytes)
	}
	data, d := repositorytest.Blob(7, 3<<20)
	if _, err := r.remote.PutBlob(ctx, d, int64(len(data)), bytes.NewReader(data)); err != nil {
		t.Fatal(err)
	}
	src, err := r.layers.OpenLayer(ctx, stack.LayerRef{Digest: string(d)})
	if err != nil {
		t.Fatal(err)
	}
	p := make([]byte, 4096)
	if _, err := src.ReadAt(p, 1<<20+5); err != nil || !bytes.Equal(p, data[1<<20+5:1<<20+5+4096]) {
		t.Fatalf("read through the lazy path: %v", err)
	}
	src.Close()
	if r.cache.Cached(d) {
		t.Fatal("a lazy read fetched the whole blob into the node cache")
	}
	st := r.blocks.Stats()
	if st.FetchedBytes == 0 || st.FetchedBytes >= int64(len(data)) {
		t.Fatalf("block cache fetched %d of %d bytes", st.FetchedBytes, len(data))
	}
	if files, _ := filepath.Glob(filepath.Join(cfg.BlockCacheDir(), "*", "*")); len(files) == 0 {
		t.Fatalf("no blocks under %s", cfg.BlockCacheDir())
	}
	want := "# HELP aenv_repository_fetched_bytes_total Bytes read from the shared repository: ranges of lazily read layers plus whole blobs fetched into the node cache.\n" +
		"# TYPE aenv_repository_fetched_bytes_total counter\n" +
		"aenv_repository_fetched_bytes_total " + strconv.FormatInt(st.FetchedBytes, 10) + "\n"
	if err := testutil.GatherAndCompare(reg, strings.NewReader(want), "aenv_repository_fetched_bytes_total"); err != nil {
		t.Fatal(err)
	}
}
