package image

import (
	"bufio"
	"bytes"
	"compress/gzip"
	"context"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"hash"
	"io"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"time"

	v1 "github.com/google/go-containerregistry/pkg/v1"
	"github.com/klauspost/compress/zstd"
	"golang.org/x/sync/errgroup"
)

// Store caches layer blobs by digest under Dir (usually <data-dir>/images):
// Dir/layers/sha256/<hex> holds the compressed blob exactly as published,
// verified against its digest before it is put in place, so images that
// share base layers download them once.
type Store struct {
	Dir string
}

// Phase names what a Progress report is about.
type Phase string

const (
	PhaseDownload Phase = "download"
	PhaseApply    Phase = "apply"
	PhaseConvert  Phase = "convert"
)

// Progress is one report about one layer. Done and Total are bytes
// (compressed while downloading, uncompressed tar bytes when applying).
type Progress struct {
	Phase  Phase
	Layer  int // 1-based
	Layers int
	Digest string
	Done   int64
	Total  int64
	Cached bool // the layer was already in the store
	Final  bool // last report for this layer in this phase
}

// ProgressFunc receives progress reports, from the pulling goroutine.
type ProgressFunc func(Progress)

func (s *Store) blobPath(digest string) (string, error) {
	h, err := v1.NewHash(digest)
	if err != nil || h.Algorithm != "sha256" {
		return "", fmt.Errorf("%w: bad layer digest %q", ErrDigestMismatch, digest)
	}
	return filepath.Join(s.Dir, "layers", "sha256", h.Hex), nil
}

// Has reports whether the blob with this digest is cached.
func (s *Store) Has(digest string) bool {
	p, err := s.blobPath(digest)
	if err != nil {
		return false
	}
	_, err = os.Stat(p)
	return err == nil
}

// touch sets a cached blob's modification time to now; an error means it is not there
// (any more).
func (s *Store) touch(digest string) error {
	p, err := s.blobPath(digest)
	if err != nil {
		return err
	}
	now := time.Now()
	return os.Chtimes(p, now, now)
}

// fetchJobs is how many layers download at once, like Docker's default of 3.
const fetchJobs = 3

// Fetch makes sure every layer blob of img is in the store, downloading the
// missing ones (a few at a time) and verifying each against its digest and
// size. Progress reports are serialized: progress is never called
// concurrently.
func (s *Store) Fetch(ctx context.Context, img *Image, progress ProgressFunc) error {
	var mu sync.Mutex
	report := func(p Progress) {
		if progress != nil {
			mu.Lock()
			progress(p)
			mu.Unlock()
		}
	}
	g, gctx := errgroup.WithContext(ctx)
	g.SetLimit(fetchJobs)
	for n, l := range img.Layers {
		p := Progress{Phase: PhaseDownload, Layer: n + 1, Layers: len(img.Layers), Digest: l.Digest, Total: l.Size}
		// A reused blob is as good as new to the data-dir GC, which spares blobs changed
		// within its grace period: the image using it is not registered yet. One the GC
		// removed meanwhile is fetched again.
		if s.touch(l.Digest) == nil {
			p.Done, p.Cached, p.Final = l.Size, true, true
			report(p)
			continue
		}
		g.Go(func() error {
			if err := s.fetch(gctx, img, l, func(done int64) { p.Done = done; report(p) }); err != nil {
				return fmt.Errorf("layer %d (%s): %w", n+1, l.Digest, err)
			}
			p.Done, p.Final = l.Size, true
			report(p)
			return nil
		})
	}
	if err := g.Wait(); err != nil {
		return err
	}
	return ctx.Err()
}

func (s *Store) fetch(ctx context.Context, img *Image, l Layer, report func(int64)) error {
	dst, err := s.blobPath(l.Digest)
	if err != nil {
		return err
	}
	h, _ := v1.NewHash(l.Digest)
	layer, err := img.img.LayerByDigest(h)
	if err != nil {
		return err
	}
	rc, err := layer.Compressed()
	if err != nil {
		return err
	}
	defer rc.Close()
	if err := os.MkdirAll(filepath.Dir(dst), 0o755); err != nil {
		return err
	}
	tmp, err := os.CreateTemp(filepath.Dir(dst), ".tmp-"+h.Hex[:12]+"-")
	if err != nil {
		return err
	}
	defer os.Remove(tmp.Name())
	sum := sha256.New()
	cw := &countWriter{report: report}
	// Read one byte past the declared size so a longer blob is caught.
	n, err := io.Copy(io.MultiWriter(tmp, sum, cw), io.LimitReader(ctxReader{ctx, rc}, l.Size+1))
	if cerr := tmp.Close(); err == nil {
		err = cerr
	}
	if err != nil {
		// ggcr's registry reader verifies the digest itself at EOF.
		if strings.Contains(err.Error(), "error verifying") {
			return fmt.Errorf("%w: download: %w", ErrDigestMismatch, err)
		}
		return fmt.Errorf("download: %w", err)
	}
	if n != l.Size {
		return fmt.Errorf("%w: blob is %d bytes, manifest says %d", ErrDigestMismatch, n, l.Size)
	}
	if got := "sha256:" + hex.EncodeToString(sum.Sum(nil)); got != l.Digest {
		return fmt.Errorf("%w: blob hashes to %s", ErrDigestMismatch, got)
	}
	return os.Rename(tmp.Name(), dst)
}

// OpenLayer opens a cached layer as its uncompressed tar. The stream is
// checked against the layer's diff id: Close (after the caller read what it
// needed) drains the rest and reports a mismatch or a decompression error.
func (s *Store) OpenLayer(l Layer) (io.ReadCloser, error) {
	p, err := s.blobPath(l.Digest)
	if err != nil {
		return nil, err
	}
	f, err := os.Open(p)
	if err != nil {
		return nil, fmt.Errorf("layer %s not in the store: %w", l.Digest, err)
	}
	br := bufio.NewReaderSize(f, 1<<16)
	magic, _ := br.Peek(4)
	var r io.Reader = br
	var closeDec func()
	switch {
	case bytes.HasPrefix(magic, []byte{0x1f, 0x8b}):
		zr, err := gzip.NewReader(br)
		if err != nil {
			f.Close()
			return nil, fmt.Errorf("layer %s: %w", l.Digest, err)
		}
		r = zr
	case bytes.HasPrefix(magic, []byte{0x28, 0xb5, 0x2f, 0xfd}):
		zr, err := zstd.NewReader(br)
		if err != nil {
			f.Close()
			return nil, fmt.Errorf("layer %s: %w", l.Digest, err)
		}
		r, closeDec = zr, zr.Close
	case strings.HasSuffix(l.MediaType, "gzip") || strings.HasSuffix(l.MediaType, "zstd"):
		f.Close()
		return nil, fmt.Errorf("layer %s: media type %s but the blob is not compressed that way", l.Digest, l.MediaType)
	}
	return &verifiedReader{r: r, f: f, h: sha256.New(), want: l.DiffID, closeDec: closeDec}, nil
}

type verifiedReader struct {
	r        io.Reader
	f        *os.File
	h        hash.Hash
	want     string
	n        int64
	closeDec func()
	err      error
}

func (v *verifiedReader) Read(p []byte) (int, error) {
	n, err := v.r.Read(p)
	v.h.Write(p[:n])
	v.n += int64(n)
	if err != nil && !errors.Is(err, io.EOF) {
		v.err = err
	}
	return n, err
}

// Size is the number of uncompressed bytes read so far.
func (v *verifiedReader) Size() int64 { return v.n }

func (v *verifiedReader) Close() error {
	defer v.f.Close()
	if v.closeDec != nil {
		defer v.closeDec()
	}
	if v.err != nil {
		return fmt.Errorf("decompress layer: %w", v.err)
	}
	if _, err := io.Copy(io.Discard, v); err != nil {
		return fmt.Errorf("decompress layer: %w", err)
	}
	if got := "sha256:" + hex.EncodeToString(v.h.Sum(nil)); got != v.want {
		return fmt.Errorf("%w: layer content hashes to %s, config says %s", ErrDigestMismatch, got, v.want)
	}
	return nil
}

type countWriter struct {
	n      int64
	last   int64
	report func(int64)
}

func (c *countWriter) Write(p []byte) (int, error) {
	c.n += int64(len(p))
	// Throttle to about one report per MiB.
	if c.n-c.last >= 1<<20 {
		c.last = c.n
		c.report(c.n)
	}
	return len(p), nil
}

type ctxReader struct {
	ctx context.Context
	r   io.Reader
}

func (c ctxReader) Read(p []byte) (int, error) {
	if err := c.ctx.Err(); err != nil {
		return 0, err
	}
	return c.r.Read(p)
}
