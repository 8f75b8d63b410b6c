// Package layered turns a root filesystem directory (the base template's, built by package
// base) into a layered template: one sealed, ZFile-compressed overlaybd layer holding an
// ext4 image of the tree. Sandboxes of a layered template run on a block root (the shared
// sealed layer plus a writable upper of their own), which is what snapshot, fork and
// pause-to-disk capture; a directory template cannot be snapshotted by the OCI backend.
//
// The conversion is idempotent: the layer is keyed by a hash of the tree's metadata, the
// filesystem size and this package's Version, and a finished one is reused. Layers of
// earlier keys are never deleted here, because snapshots taken from sandboxes of an older
// base still name them as their bottom lower.
package layered

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"time"

	"github.com/aenv-dev/aenv/internal/atomicfile"
	"github.com/aenv-dev/aenv/internal/catalog"
	"github.com/aenv-dev/aenv/internal/dirlock"
	"github.com/aenv-dev/aenv/internal/sandbox"

	"github.com/aenv-dev/aenv/internal/image"
	"github.com/aenv-dev/aenv/internal/storage/lsmt"
	"github.com/aenv-dev/aenv/internal/storage/stack"
	"github.com/aenv-dev/aenv/internal/storage/zfile"
)

// Version is part of every key; bump it when the layer's content for a given tree changes
// (mkfs options, compression), so existing layers are rebuilt.
const Version = "aenv-layered-1"

// ArtifactKind marks catalog artifacts made by FromRootFS.
const ArtifactKind = "layered-rootfs"

// MinSizeMB is the smallest filesystem FromRootFS makes (mkfs.ext4's practical floor).
const MinSizeMB = 8

// File names inside outDir, per key.
const (
	layerExt    = ".zfile"
	manifestExt = ".stack.json" // written last: its presence marks a finished layer
)

// ErrInvalid marks bad arguments (no such directory, a size too small).
var ErrInvalid = errors.New("layered: invalid argument")

// Artifact is the catalog artifact of a layered template.
type Artifact struct {
	Kind      string             `json:"kind"` // ArtifactKind
	Key       string             `json:"key"`  // the tree/size/version hash the layer was built for
	Overlaybd catalog.LayerStack `json:"overlaybd"`
}

// Result is what FromRootFS made or found.
type Result struct {
	Artifact json.RawMessage
	// Manifest is the path of the one-lower stack manifest (stack.LoadManifest reads it).
	Manifest string
	// Built is false when a finished layer for this tree was reused.
	Built   bool
	Elapsed time.Duration
}

// FromRootFS makes (or reuses) the layered form of rootfsDir in outDir: an ext4 image of
// sizeMB MiB populated from the tree with mkfs.ext4 -d, imported with lsmt.Import as one
// committed layer compressed with ZFile (LZ4), and a stack manifest naming it as the only
// lower. It returns the catalog artifact. It needs mkfs.ext4 but no root, FUSE or loop
// device. On error outDir holds nothing new but temporary files already removed.
func FromRootFS(ctx context.Context, rootfsDir, outDir string, sizeMB int) (json.RawMessage, error) {
	r, err := Build(ctx, rootfsDir, outDir, sizeMB)
	if err != nil {
		return nil, err
	}
	return r.Artifact, nil
}

// Build is FromRootFS that also says whether it built and where the manifest is.
func Build(ctx context.Context, rootfsDir, outDir string, sizeMB int) (*Result, error) {
	start := time.Now()
	if sizeMB < MinSizeMB {
		return nil, fmt.Errorf("%w: filesystem size %d MiB (at least %d)", ErrInvalid, sizeMB, MinSizeMB)
	}
	if fi, err := os.Stat(rootfsDir); err != nil || !fi.IsDir() {
		return nil, fmt.Errorf("%w: root filesystem %s is not a directory", ErrInvalid, rootfsDir)
	}
	tree, err := TreeHash(ctx, rootfsDir)
	if err != nil {
		return nil, err
	}
	key := keyOf(tree, sizeMB)
	if err := os.MkdirAll(outDir, 0o755); err != nil {
		return nil, fmt.Errorf("layered: %w", err)
	}
	// Two nodes' starts or two tests must never write the same temporary files.
	unlock, err := dirlock.Acquire(ctx, outDir)
	if err != nil {
		return nil, fmt.Errorf("layered: %w", err)
	}
	defer unlock()

	manifest := filepath.Join(outDir, key+manifestExt)
	if art, err := load(manifest, key); err == nil {
		return &Result{Artifact: art, Manifest: manifest, Elapsed: time.Since(start)}, nil
	}
	layer := filepath.Join(outDir, key+layerExt)
	ref, err := buildLayer(ctx, rootfsDir, layer, sizeMB)
	if err != nil {
		return nil, err
	}
	m := stack.Manifest{VirtualSize: uint64(sizeMB) << 20, Lowers: []stack.LayerRef{ref}}
	if err := writeJSON(manifest, m); err != nil {
		return nil, err
	}
	art, err := load(manifest, key)
	if err != nil {
		return nil, err
	}
	return &Result{Artifact: art, Manifest: manifest, Built: true, Elapsed: time.Since(start)}, nil
}

// keyOf names the layer for a tree hash and size.
func keyOf(tree string, sizeMB int) string {
	h := sha256.Sum256(fmt.Appendf(nil, "%s\n%s\n%d", Version, tree, sizeMB))
	return hex.EncodeToString(h[:16])
}

// load reads a finished manifest and turns it into the artifact, checking that its layer
// is still there and as large as recorded (a truncated or deleted layer is rebuilt).
func load(manifest, key string) (json.RawMessage, error) {
	m, err := stack.LoadManifest(manifest)
	if err != nil {
		return nil, err
	}
	if len(m.Lowers) != 1 {
		return nil, fmt.Errorf("layered: %s: %d lowers, want 1", manifest, len(m.Lowers))
	}
	ref := m.Lowers[0]
	if fi, err := os.Stat(ref.Path); err != nil || fi.Size() != ref.Size {
		return nil, fmt.Errorf("layered: layer %s is missing or changed", ref.Path)
	}
	return json.Marshal(Artifact{Kind: ArtifactKind, Key: key,
		Overlaybd: catalog.LayerStack{SizeMB: int(m.VirtualSize >> 20), Layers: []sandbox.LayerRef{sandbox.LayerRef(ref)}}})
}

// buildLayer writes the ext4 image of rootfsDir as a compressed committed layer at out
// (through a temporary sibling) and describes it.
func buildLayer(ctx context.Context, rootfsDir, out string, sizeMB int) (stack.LayerRef, error) {
	dir := filepath.Dir(out)
	raw := filepath.Join(dir, "."+filepath.Base(out)+".ext4")
	defer os.Remove(raw)
	if err := image.BuildExt4(ctx, rootfsDir, raw, sizeMB); err != nil {
		return stack.LayerRef{}, fmt.Errorf("layered: %w", err)
	}
	if err := ctx.Err(); err != nil {
		return stack.LayerRef{}, err
	}
	tmp := out + ".tmp"
	os.Remove(tmp)
	ok := false
	defer func() {
		if !ok {
			os.Remove(tmp)
		}
	}()
	info, err := importCompressed(raw, tmp)
	if err != nil {
		return stack.LayerRef{}, err
	}
	ref, err := describe(tmp, info.UUID)
	if err != nil {
		return stack.LayerRef{}, err
	}
	if err := os.Rename(tmp, out); err != nil {
		return stack.LayerRef{}, fmt.Errorf("layered: %w", err)
	}
	ok = true
	ref.Path = out
	return ref, nil
}

// importCompressed imports the raw ext4 image into a committed LSMT layer written through
// a ZFile (LZ4, 4 KiB blocks, checksummed) compressor to out.
func importCompressed(raw, out string) (lsmt.CommitInfo, error) {
	src, err := os.Open(raw)
	if err != nil {
		return lsmt.CommitInfo{}, fmt.Errorf("layered: %w", err)
	}
	defer src.Close()
	f, err := os.OpenFile(out, os.O_CREATE|os.O_EXCL|os.O_WRONLY, 0o644)
	if err != nil {
		return lsmt.CommitInfo{}, fmt.Errorf("layered: %w", err)
	}
	var info lsmt.CommitInfo
	z, err := zfile.NewWriter(f, zfile.WriterOptions{Algo: zfile.AlgoLZ4})
	if err == nil {
		info, err = lsmt.Import(z, src, lsmt.CommitOptions{})
		if cerr := z.Close(); err == nil {
			err = cerr
		}
	}
	if err == nil {
		err = f.Sync()
	}
	if cerr := f.Close(); err == nil {
		err = cerr
	}
	if err != nil {
		return lsmt.CommitInfo{}, fmt.Errorf("layered: import ext4 image: %w", err)
	}
	return info, nil
}

// describe gives the layer's size and content digest, so it can be published to a
// repository and fetched by digest like any other sealed layer.
func describe(path, uuid string) (stack.LayerRef, error) {
	f, err := os.Open(path)
	if err != nil {
		return stack.LayerRef{}, fmt.Errorf("layered: %w", err)
	}
	defer f.Close()
	h := sha256.New()
	n, err := io.Copy(h, f)
	if err != nil {
		return stack.LayerRef{}, fmt.Errorf("layered: digest %s: %w", path, err)
	}
	return stack.LayerRef{Size: n, UUID: uuid, Digest: "sha256:" + hex.EncodeToString(h.Sum(nil))}, nil
}

// writeJSON writes v to path atomically (temporary sibling, fsync, rename).
func writeJSON(path string, v any) error {
	b, err := json.MarshalIndent(v, "", "  ")
	if err != nil {
		return err
	}
	if err := atomicfile.WriteFile(path, append(b, '\n'), 0o644); err != nil {
		return fmt.Errorf("layered: %w", err)
	}
	return nil
}
