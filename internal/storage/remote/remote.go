// Package remote provides lazy, ranged sources for sealed layers (an HTTP
// server that answers Range requests, such as a registry blob URL or a
// repository's blob endpoint, and a local blob directory) and a stack
// resolver that reads them through the block cache.
package remote

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net/http"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"time"

	"github.com/google/go-containerregistry/pkg/authn"

	"github.com/aenv-dev/aenv/internal/storage/cache"
	"github.com/aenv-dev/aenv/internal/storage/stack"
)

// ErrNotFound marks a blob the source does not have.
var ErrNotFound = errors.New("remote: blob not found")

// HTTP reads a blob with Range requests.
type HTTP struct {
	url    string
	client *http.Client
	size   int64
}

// OpenHTTP learns the blob's size with a one-byte range request.
func OpenHTTP(ctx context.Context, url string, client *http.Client) (*HTTP, error) {
	if client == nil {
		client = &http.Client{Timeout: 30 * time.Second}
	}
	h := &HTTP{url: url, client: client}
	resp, err := h.get(ctx, 0, 1)
	if err != nil {
		return nil, err
	}
	resp.Body.Close()
	cr := resp.Header.Get("Content-Range")
	i := strings.LastIndexByte(cr, '/')
	if resp.StatusCode != http.StatusPartialContent || i < 0 {
		return nil, fmt.Errorf("remote %s: server does not support ranges (status %d, Content-Range %q)", url, resp.StatusCode, cr)
	}
	if h.size, err = strconv.ParseInt(cr[i+1:], 10, 64); err != nil || h.size < 0 {
		return nil, fmt.Errorf("remote %s: bad Content-Range %q", url, cr)
	}
	return h, nil
}

func (h *HTTP) get(ctx context.Context, off, n int64) (*http.Response, error) {
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, h.url, nil)
	if err != nil {
		return nil, fmt.Errorf("remote: %w", err)
	}
	req.Header.Set("Range", fmt.Sprintf("bytes=%d-%d", off, off+n-1))
	resp, err := h.client.Do(req)
	if err != nil {
		return nil, fmt.Errorf("remote %s: %w", h.url, err)
	}
	switch resp.StatusCode {
	case http.StatusOK, http.StatusPartialContent:
		return resp, nil
	case http.StatusNotFound:
		resp.Body.Close()
		return nil, fmt.Errorf("%w: %s", ErrNotFound, h.url)
	}
	resp.Body.Close()
	return nil, fmt.Errorf("remote %s: range %d+%d: status %d", h.url, off, n, resp.StatusCode)
}

// Size is the blob size.
func (h *HTTP) Size() int64 { return h.size }

// ReadAt fetches [off, off+len(p)), retrying transient failures.
func (h *HTTP) ReadAt(ctx context.Context, p []byte, off int64) (int, error) {
	if off >= h.size {
		return 0, io.EOF
	}
	want := p[:min(int64(len(p)), h.size-off)]
	var err error
	for try := 0; try < 3; try++ {
		if try > 0 {
			select {
			case <-ctx.Done():
				return 0, ctx.Err()
			case <-time.After(time.Duration(try) * 50 * time.Millisecond):
			}
		}
		var n int
		if n, err = h.readOnce(ctx, want, off); err == nil {
			if len(want) < len(p) {
				return n, io.EOF
			}
			return n, nil
		}
		if errors.Is(err, ErrNotFound) || ctx.Err() != nil {
			break
		}
	}
	return 0, err
}

func (h *HTTP) readOnce(ctx context.Context, p []byte, off int64) (int, error) {
	resp, err := h.get(ctx, off, int64(len(p)))
	if err != nil {
		return 0, err
	}
	defer resp.Body.Close()
	body := io.Reader(resp.Body)
	if resp.StatusCode == http.StatusOK {
		// Server ignored Range: skip to the offset.
		if _, err := io.CopyN(io.Discard, body, off); err != nil {
			return 0, fmt.Errorf("remote %s: %w", h.url, err)
		}
	}
	n, err := io.ReadFull(body, p)
	if err != nil {
		return n, fmt.Errorf("remote %s: range %d+%d: %w", h.url, off, len(p), err)
	}
	return n, nil
}

// File is a blob in a local directory, read as a Source (e.g. a posix_fs
// repository on NFS).
type File struct {
	f    *os.File
	size int64
}

// OpenFile opens a local blob.
func OpenFile(path string) (*File, error) {
	f, err := os.Open(path)
	if errors.Is(err, os.ErrNotExist) {
		return nil, fmt.Errorf("%w: %s", ErrNotFound, path)
	}
	if err != nil {
		return nil, fmt.Errorf("remote: %w", err)
	}
	st, err := f.Stat()
	if err != nil {
		f.Close()
		return nil, fmt.Errorf("remote: %w", err)
	}
	return &File{f: f, size: st.Size()}, nil
}

// Size is the blob size.
func (f *File) Size() int64 { return f.size }

// ReadAt reads the file; ctx is not consulted for local reads.
func (f *File) ReadAt(_ context.Context, p []byte, off int64) (int, error) { return f.f.ReadAt(p, off) }

// Close closes the file.
func (f *File) Close() error { return f.f.Close() }

// Resolver opens stack lowers by digest from a base location, through a
// block cache. Base is one of: an http(s) URL prefix (the blob is Base +
// "/" + digest, as overlaybd's repoBlobUrl); "oci://host/repo" for an OCI
// registry repository (anonymous, or Auth); or a local directory holding
// <algo>/<hex> files (an OCI layout's blobs directory).
type Resolver struct {
	Base   string
	Cache  *cache.Cache
	Client *http.Client        // for http(s) bases
	Auth   authn.Authenticator // for oci:// bases
}

var _ stack.Resolver = (*Resolver)(nil)

// OpenLayer implements stack.Resolver.
func (r *Resolver) OpenLayer(ctx context.Context, ref stack.LayerRef) (stack.Source, error) {
	algo, hex, ok := strings.Cut(ref.Digest, ":")
	if !ok || algo == "" || hex == "" || strings.ContainsAny(ref.Digest, "/\\") {
		return nil, fmt.Errorf("remote: bad digest %q", ref.Digest)
	}
	var src cache.Source
	var closer func() error
	if repo, ok := strings.CutPrefix(r.Base, "oci://"); ok {
		h, err := OpenRegistry(ctx, repo+"@"+ref.Digest, r.Auth, nil)
		if err != nil {
			return nil, err
		}
		src, closer = h, func() error { return nil }
	} else if strings.HasPrefix(r.Base, "http://") || strings.HasPrefix(r.Base, "https://") {
		h, err := OpenHTTP(ctx, strings.TrimSuffix(r.Base, "/")+"/"+ref.Digest, r.Client)
		if err != nil {
			return nil, err
		}
		src, closer = h, func() error { return nil }
	} else {
		f, err := OpenFile(filepath.Join(r.Base, algo, hex))
		if err != nil {
			return nil, err
		}
		src, closer = f, f.Close
	}
	if ref.Size > 0 && src.Size() != ref.Size {
		closer()
		return nil, fmt.Errorf("remote: blob %s is %d bytes, manifest says %d", ref.Digest, src.Size(), ref.Size)
	}
	if r.Cache == nil {
		return &direct{src: src, close: closer}, nil
	}
	return &cached{File: r.Cache.File(ref.Digest, src), close: closer}, nil
}

type cached struct {
	*cache.File
	close func() error
}

func (c *cached) Close() error { return c.close() }

type direct struct {
	src   cache.Source
	close func() error
}

func (d *direct) ReadAt(p []byte, off int64) (int, error) {
	return d.src.ReadAt(context.Background(), p, off)
}
func (d *direct) Size() int64  { return d.src.Size() }
func (d *direct) Close() error { return d.close() }
