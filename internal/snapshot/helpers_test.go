package snapshot

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"math/rand/v2"
	"path/filepath"
	"sync"
	"testing"
	"time"

	"github.com/aenv-dev/aenv/internal/catalog"
	"github.com/aenv-dev/aenv/internal/repository"
	"github.com/aenv-dev/aenv/internal/repository/nodecache"
	"github.com/aenv-dev/aenv/internal/repository/posixfs"
	"github.com/aenv-dev/aenv/internal/repository/s3"
	"github.com/aenv-dev/aenv/internal/repository/s3/s3test"
	"github.com/aenv-dev/aenv/internal/storage/stack"
)

const testVSize = 8 << 20

// backend opens one shared remote repository per call.
type backend struct {
	name string
	open func(t testing.TB) repository.Repository
}

func posixBackend() backend {
	return backend{"posixfs", func(t testing.TB) repository.Repository {
		r, err := posixfs.Open(t.TempDir(), posixfs.Options{})
		if err != nil {
			t.Fatal(err)
		}
		return r
	}}
}

func s3Backend() backend {
	return backend{"s3", func(t testing.TB) repository.Repository {
		srv := s3test.Start(t) // skips when versitygw is missing
		r, err := s3.Open(context.Background(), s3.Config{Endpoint: srv.Endpoint, Bucket: srv.Bucket(t),
			Addressing: s3.AddressPath, AccessKey: s3test.AccessKey, SecretKey: s3test.SecretKey})
		if err != nil {
			t.Fatal(err)
		}
		return r
	}}
}

func backends() []backend { return []backend{posixBackend(), s3Backend()} }

// node is one aenv node: its own catalog, node cache and publisher over a
// shared remote repository.
type node struct {
	name     string
	remote   repository.Repository
	cache    *nodecache.Cache
	cat      *catalog.Catalog
	pub      *Publisher
	state    string
	cacheDir string
	opts     Options
}

func newNode(t testing.TB, name string, remote repository.Repository, o Options) *node {
	t.Helper()
	dir := t.TempDir()
	n := &node{name: name, remote: remote, state: filepath.Join(dir, "state"), cacheDir: filepath.Join(dir, "cache")}
	cat, err := catalog.Open(filepath.Join(dir, "aenv.db"))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { cat.Close() })
	n.cat = cat
	o.NodeID, o.StateDir = name, n.state
	if o.RetryBase == 0 {
		o.RetryBase = 10 * time.Millisecond
	}
	if o.GCGrace == 0 {
		o.GCGrace = -1
	}
	n.opts = o
	n.open(t, remote)
	return n
}

// open (re)opens the node's cache and publisher, as a restart does.
func (n *node) open(t testing.TB, remote repository.Repository) {
	t.Helper()
	c, err := nodecache.Open(context.Background(), remote, nodecache.Options{Dir: n.cacheDir, MaxBytes: 512 << 20})
	if err != nil {
		t.Fatal(err)
	}
	n.cache = c
	p, err := New(c, n.cat.Templates(), n.opts)
	if err != nil {
		t.Fatal(err)
	}
	n.pub = p
	t.Cleanup(func() { p.Close() })
}

// stackLayers seals count real LSMT layers, each holding writes of random
// blocks, as a sandbox's snapshots would, and returns them bottom first
// with the device content they stack to.
func stackLayers(t testing.TB, dir string, count int, seed uint64) ([]LayerFile, []byte) {
	t.Helper()
	ctx := context.Background()
	m := &stack.Manifest{VirtualSize: testVSize, Dir: dir, MaxDepth: 200, Upper: &stack.Upper{Data: "upper.data", Index: "upper.index"}}
	s, err := stack.Open(ctx, m, stack.Options{})
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	rng := rand.New(rand.NewPCG(seed, seed^0x9e3779b9))
	model := make([]byte, testVSize)
	var out []LayerFile
	for i := range count {
		for range 16 {
			blk := make([]byte, 4096)
			for j := range blk {
				blk[j] = byte(rng.Uint32())
			}
			off := int64(rng.IntN(testVSize/4096)) * 4096
			if _, err := s.WriteAt(blk, off); err != nil {
				t.Fatal(err)
			}
			copy(model[off:], blk)
		}
		if err := s.Sync(); err != nil {
			t.Fatal(err)
		}
		ref, err := s.SealAndRestack(ctx, filepath.Join(dir, fmt.Sprintf("layer-%d.commit", i)))
		if err != nil {
			t.Fatal(err)
		}
		out = append(out, LayerFile{Path: ref.Path, UUID: ref.UUID, Size: ref.Size})
	}
	return out, model
}

// captureArtifact is shaped like the OCI backend's capture: the layers as
// stack.LayerRef objects with local paths and no digests.
func captureArtifact(t testing.TB, files []LayerFile) json.RawMessage {
	refs := make([]stack.LayerRef, len(files))
	for i, f := range files {
		refs[i] = stack.LayerRef{Path: f.Path, Size: f.Size, UUID: f.UUID}
	}
	b, err := json.Marshal(map[string]any{"version": 1, "backend": "oci", "layers": refs, "virtualSize": testVSize})
	if err != nil {
		t.Fatal(err)
	}
	return b
}

func testManifest(t testing.TB, id string, files []LayerFile) Manifest {
	return Manifest{ID: id, Kind: repository.KindSnapshot, Layers: files,
		Resources: repository.Resources{CPUCount: 1, MemoryMB: 256},
		Config:    Defaults{EnvVars: map[string]string{"A": "1"}, DefaultUser: "user", Artifact: captureArtifact(t, files)},
		Backend:   "oci", SourceSandbox: "sbx-" + id, EnvdVersion: "0.5.15"}
}

// readStack opens the layers an artifact names (by path) and reads the
// whole device.
func readStack(t testing.TB, art json.RawMessage) []byte {
	t.Helper()
	return readLazy(t, artifactRefs(t, art), nil)
}

// gated is a real repository whose blob uploads wait until the gate opens:
// a test harness that holds a publication in its upload phase.
type gated struct {
	repository.Repository
	mu     sync.Mutex
	gate   chan struct{}
	puts   chan repository.Digest // each PutBlob that reached the gate
	fails  chan error             // each PutBlob the real repository failed
	closed bool
}

func newGated(r repository.Repository) *gated {
	return &gated{Repository: r, gate: make(chan struct{}), puts: make(chan repository.Digest, 64), fails: make(chan error, 64)}
}

func (g *gated) PutBlob(ctx context.Context, d repository.Digest, size int64, r io.Reader) (repository.BlobInfo, error) {
	select {
	case g.puts <- d:
	default:
	}
	select {
	case <-g.gate:
	case <-ctx.Done():
		return repository.BlobInfo{}, ctx.Err()
	}
	info, err := g.Repository.PutBlob(ctx, d, size, r)
	if err != nil {
		select {
		case g.fails <- err:
		default:
		}
	}
	return info, err
}

func (g *gated) open() {
	g.mu.Lock()
	defer g.mu.Unlock()
	if !g.closed {
		g.closed = true
		close(g.gate)
	}
}

func waitFor(t testing.TB, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(20 * time.Second)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out waiting for %s", what)
		}
		time.Sleep(5 * time.Millisecond)
	}
}
