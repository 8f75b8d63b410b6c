package remote

import (
	"bytes"
	"context"
	"io"
	"log"
	"net/http/httptest"
	"net/url"
	"os"
	"testing"

	"github.com/google/go-containerregistry/pkg/name"
	"github.com/google/go-containerregistry/pkg/registry"
	ggcrremote "github.com/google/go-containerregistry/pkg/v1/remote"
	"github.com/google/go-containerregistry/pkg/v1/static"
	"github.com/google/go-containerregistry/pkg/v1/types"

	"github.com/aenv-dev/aenv/internal/storage/cache"
	"github.com/aenv-dev/aenv/internal/storage/stack"
)

// TestRegistryLayer pushes the vector as a blob to an in-process OCI
// registry and reads it lazily as a stack lower.
func TestRegistryLayer(t *testing.T) {
	ctx := context.Background()
	srv := httptest.NewServer(registry.New(registry.Logger(log.New(io.Discard, "", 0))))
	defer srv.Close()
	u, _ := url.Parse(srv.URL)
	raw, err := os.ReadFile(hwPath)
	if err != nil {
		t.Fatal(err)
	}
	repo, err := name.NewRepository(u.Host + "/test/hw")
	if err != nil {
		t.Fatal(err)
	}
	if err := ggcrremote.WriteLayer(repo, static.NewLayer(raw, types.OCILayer)); err != nil {
		t.Fatalf("push: %v", err)
	}
	c, _ := cache.Open(cache.Options{Dir: t.TempDir(), MaxBytes: 1 << 20, BlockSize: 64 << 10})
	defer c.Close()
	res := &Resolver{Base: "oci://" + u.Host + "/test/hw", Cache: c}
	s, err := stack.Open(ctx, &stack.Manifest{Lowers: []stack.LayerRef{{Digest: hwDigest}}}, stack.Options{Resolver: res})
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	two := make([]byte, 2)
	if _, err := s.ReadAt(two, 1080); err != nil || two[0] != 0x53 || two[1] != 0xEF {
		t.Fatalf("magic % x %v", two, err)
	}
	if _, err := OpenRegistry(ctx, u.Host+"/test/hw@sha256:"+string(bytes.Repeat([]byte("0"), 64)), nil, nil); err == nil {
		t.Fatal("missing blob opened")
	}
}
