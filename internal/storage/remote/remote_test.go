package remote

import (
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"sync/atomic"
	"testing"
	"time"

	"github.com/aenv-dev/aenv/internal/storage/cache"
	"github.com/aenv-dev/aenv/internal/storage/stack"
)

const hwPath = "../blob/testdata/hw_layer.bin"
const hwDigest = "sha256:022231c3f1af70e0cc42f0c3781eabf174cff608210585bf93fc83e16d33672d"

// blobServer serves hw_layer.bin at /blobs/<digest> with Range support and
// counts the bytes it sends.
func blobServer(t *testing.T) (*httptest.Server, *atomic.Int64) {
	t.Helper()
	raw, err := os.ReadFile(hwPath)
	if err != nil {
		t.Fatal(err)
	}
	var sent atomic.Int64
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Path != "/blobs/"+hwDigest {
			http.NotFound(w, r)
			return
		}
		cw := &countingWriter{ResponseWriter: w, n: &sent}
		http.ServeContent(cw, r, "blob", time.Time{}, bytes.NewReader(raw))
	}))
	t.Cleanup(srv.Close)
	return srv, &sent
}

type countingWriter struct {
	http.ResponseWriter
	n *atomic.Int64
}

func (c *countingWriter) Write(p []byte) (int, error) {
	c.n.Add(int64(len(p)))
	return c.ResponseWriter.Write(p)
}

func TestLazyRemoteStack(t *testing.T) {
	ctx := context.Background()
	srv, sent := blobServer(t)
	c, err := cache.Open(cache.Options{Dir: t.TempDir(), MaxBytes: 64 << 10, BlockSize: 16 << 10})
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	res := &Resolver{Base: srv.URL + "/blobs", Cache: c}
	s, err := stack.Open(ctx, &stack.Manifest{Dir: t.TempDir(), Lowers: []stack.LayerRef{{Digest: hwDigest, Size: 642560}}},
		stack.Options{Resolver: res})
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	opened := sent.Load()
	if opened > 160<<10 {
		t.Fatalf("open fetched %d bytes of a 642560-byte blob", opened)
	}
	two := make([]byte, 2)
	if _, err := s.ReadAt(two, 1080); err != nil || two[0] != 0x53 || two[1] != 0xEF {
		t.Fatalf("magic % x %v", two, err)
	}
	if d := sent.Load() - opened; d > 64<<10 {
		t.Fatalf("a 2-byte read fetched %d bytes", d)
	}
	// A read larger than the whole cache still returns the golden bytes.
	buf := make([]byte, 4<<20)
	if _, err := s.ReadAt(buf, 0); err != nil {
		t.Fatal(err)
	}
	sum := sha256.Sum256(buf)
	if got := hex.EncodeToString(sum[:]); got != "1ba9757892e20ff13d4dc47e72694349129a92f41f20b65010a4082f3261466c" {
		t.Fatalf("sha256 %s", got)
	}
	if st := c.Stats(); st.UsedBytes > 64<<10 || st.Evictions == 0 {
		t.Fatalf("cache stats %+v", st)
	}
}

func TestDirResolverAndErrors(t *testing.T) {
	ctx := context.Background()
	dir := t.TempDir()
	os.MkdirAll(filepath.Join(dir, "sha256"), 0o755)
	raw, _ := os.ReadFile(hwPath)
	os.WriteFile(filepath.Join(dir, "sha256", hwDigest[7:]), raw, 0o644)
	res := &Resolver{Base: dir}
	src, err := res.OpenLayer(ctx, stack.LayerRef{Digest: hwDigest})
	if err != nil {
		t.Fatal(err)
	}
	src.Close()
	for _, ref := range []stack.LayerRef{{Digest: "sha256:0000"}, {Digest: "nocolon"}, {Digest: "sha256:../../etc"},
		{Digest: hwDigest, Size: 5}} {
		if s, err := res.OpenLayer(ctx, ref); err == nil {
			s.Close()
			t.Errorf("%+v accepted", ref)
		}
	}
	srv, _ := blobServer(t)
	if _, err := OpenHTTP(ctx, srv.URL+"/blobs/sha256:missing", nil); !errors.Is(err, ErrNotFound) {
		t.Fatalf("missing blob: %v", err)
	}
}
