package image

import (
	"context"
	"errors"
	"fmt"
	"os"
	"strings"

	v1 "github.com/google/go-containerregistry/pkg/v1"
	"github.com/google/go-containerregistry/pkg/v1/layout"

	"github.com/aenv-dev/aenv/internal/image/unpack"
)

// refNameAnnotation tags a manifest in an OCI layout's index.json.
const refNameAnnotation = "org.opencontainers.image.ref.name"

// maxIndexDepth bounds nested indexes (a hostile layout could loop).
const maxIndexDepth = 4

// fromLayout opens an OCI image layout directory and picks one image: the
// manifest tagged tag (when given), else the only one, resolving indexes to
// the platform.
func fromLayout(dir, tag string, plat v1.Platform) (v1.Image, error) {
	if _, err := os.Stat(dir); err != nil {
		return nil, fmt.Errorf("%w: %w", ErrNotFound, err)
	}
	p, err := layout.FromPath(dir)
	if err != nil {
		return nil, fmt.Errorf("oci layout %s: %w", dir, err)
	}
	idx, err := p.ImageIndex()
	if err != nil {
		return nil, fmt.Errorf("oci layout %s: %w", dir, err)
	}
	im, err := idx.IndexManifest()
	if err != nil {
		return nil, fmt.Errorf("oci layout %s: %w", dir, err)
	}
	descs := im.Manifests
	if tag != "" {
		descs = nil
		for _, d := range im.Manifests {
			n := d.Annotations[refNameAnnotation]
			if n == tag || strings.HasSuffix(n, ":"+tag) {
				descs = append(descs, d)
			}
		}
		if len(descs) == 0 {
			return nil, fmt.Errorf("%w: no manifest tagged %q in %s", ErrNotFound, tag, dir)
		}
	}
	return pick(idx, descs, plat, 0)
}

// pick chooses the image among descs for plat, descending into indexes.
func pick(idx v1.ImageIndex, descs []v1.Descriptor, plat v1.Platform, depth int) (v1.Image, error) {
	if depth > maxIndexDepth {
		return nil, errors.New("image indexes nested too deep")
	}
	var cands []v1.Descriptor
	for _, d := range descs {
		if d.Platform != nil && d.Platform.OS != "" && !d.Platform.Satisfies(plat) {
			continue
		}
		if d.MediaType.IsImage() || d.MediaType.IsIndex() {
			cands = append(cands, d)
		}
	}
	if len(cands) == 0 {
		return nil, fmt.Errorf("%w: none of %d manifests is an image for %s", ErrPlatform, len(descs), plat.String())
	}
	if len(cands) > 1 && depth == 0 && cands[0].Platform == nil {
		return nil, fmt.Errorf("%w: the layout holds %d images; name one with oci:PATH:TAG", ErrBadReference, len(cands))
	}
	d := cands[0]
	if d.MediaType.IsImage() {
		img, err := idx.Image(d.Digest)
		if err != nil {
			return nil, fmt.Errorf("image %s: %w", d.Digest, err)
		}
		return img, nil
	}
	child, err := idx.ImageIndex(d.Digest)
	if err != nil {
		return nil, fmt.Errorf("index %s: %w", d.Digest, err)
	}
	cm, err := child.IndexManifest()
	if err != nil {
		return nil, fmt.Errorf("index %s: %w", d.Digest, err)
	}
	return pick(child, cm.Manifests, plat, depth+1)
}

// unpackArchive extracts an oci-archive (a tar of an OCI layout) into a new
// temporary directory, with the same traversal-safe applier as layers.
func unpackArchive(ctx context.Context, path, tmp string) (string, error) {
	f, err := os.Open(path)
	if err != nil {
		return "", fmt.Errorf("%w: %w", ErrNotFound, err)
	}
	defer f.Close()
	dir, err := os.MkdirTemp(tmp, "aenv-oci-archive-")
	if err != nil {
		return "", err
	}
	if _, err := unpack.Apply(ctx, dir, f, unpack.Options{NoChown: true}); err != nil {
		os.RemoveAll(dir)
		return "", fmt.Errorf("oci archive %s: %w", path, err)
	}
	return dir, nil
}
