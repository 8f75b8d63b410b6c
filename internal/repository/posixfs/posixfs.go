// Package posixfs is a repository on a directory that several nodes may
// share (a local disk, NFS, CPFS). Layout under the root:
//
//	aenv-repository.json         layout marker {"layout": 1}
//	blobs/sha256/<hex>           blob bytes, read-only; mtime = last put (GC grace)
//	records/<kind>/<id>.json     a record (template or snapshot manifest)
//	records/<kind>/<id>.lock     lock file while a writer updates that record
//	tmp/                         uploads and record writes in flight; GC trash
//
// Publication is atomic: bytes go to a file in tmp/ on the same filesystem,
// are fsynced, verified, then hard-linked (blobs: no-clobber, so concurrent
// writers of one digest both succeed and one copy stays) or renamed
// (records) into place, and the parent directory is fsynced. Readers never
// see a partial blob or record. Record writers serialize through O_EXCL lock
// files (see lock.go), which work across NFS clients where flock does not.
package posixfs

import (
	"context"
	"errors"
	"fmt"
	"hash/fnv"
	"io"
	"log/slog"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"time"

	"github.com/aenv-dev/aenv/internal/repository"
)

// Options tune a Repo.
type Options struct {
	// LockTimeout bounds waiting for a record lock (default 10 s).
	LockTimeout time.Duration
	// StaleLockAge is when a lock file is taken over regardless of its
	// holder (default 60 s); record updates hold locks for milliseconds.
	StaleLockAge time.Duration
	// StaleTmpAge is when leftovers in tmp/ from crashed writers are removed
	// at Open (default 1 h; uploads in flight from other nodes are younger).
	StaleTmpAge time.Duration
	Logger      *slog.Logger
}

// Repo is a repository on a directory.
type Repo struct {
	root string
	host string
	o    Options
}

var _ repository.Repository = (*Repo)(nil)

const layoutFile = "aenv-repository.json"

// Open prepares root (creating it when missing) and removes stale leftovers
// of crashed writers.
func Open(root string, o Options) (*Repo, error) {
	if o.LockTimeout <= 0 {
		o.LockTimeout = 10 * time.Second
	}
	if o.StaleLockAge <= 0 {
		o.StaleLockAge = 60 * time.Second
	}
	if o.StaleTmpAge <= 0 {
		o.StaleTmpAge = time.Hour
	}
	if o.Logger == nil {
		o.Logger = slog.Default()
	}
	host, err := os.Hostname()
	if err != nil {
		return nil, fmt.Errorf("posixfs: hostname: %w", err)
	}
	r := &Repo{root: root, host: host, o: o}
	dirs := []string{r.path("blobs", "sha256"), r.path("tmp")}
	for _, k := range repository.Kinds() {
		dirs = append(dirs, r.path("records", string(k)))
	}
	for _, d := range dirs {
		if err := os.MkdirAll(d, 0o755); err != nil {
			return nil, fmt.Errorf("posixfs: %w", err)
		}
	}
	marker := r.path(layoutFile)
	if b, err := os.ReadFile(marker); errors.Is(err, os.ErrNotExist) {
		if err := r.writeFileAtomic(marker, []byte("{\"layout\": 1}\n")); err != nil {
			return nil, err
		}
	} else if err != nil {
		return nil, fmt.Errorf("posixfs: %w", err)
	} else if string(b) != "{\"layout\": 1}\n" {
		return nil, fmt.Errorf("%w: %s has unknown layout %q", repository.ErrInvalid, root, b)
	}
	r.cleanTmp()
	return r, nil
}

// Root is the repository directory.
func (r *Repo) Root() string { return r.root }

func (r *Repo) path(elem ...string) string {
	return filepath.Join(append([]string{r.root}, elem...)...)
}

func (r *Repo) blobPath(d repository.Digest) string { return r.path("blobs", "sha256", d.Hex()) }

func (r *Repo) cleanTmp() {
	ents, err := os.ReadDir(r.path("tmp"))
	if err != nil {
		return
	}
	for _, e := range ents {
		name := e.Name()
		if hex, ok := strings.CutPrefix(name, "gc-"); ok && len(hex) > 64 {
			// A GC that crashed between moving a blob aside and deciding
			// may have been about to restore it: put it back (never over a
			// newer copy); the next GC deletes it again if it is unused.
			if d := repository.Digest("sha256:" + hex[:64]); d.Validate() == nil {
				_ = os.Link(r.path("tmp", name), r.blobPath(d))
			}
			os.Remove(r.path("tmp", name))
			continue
		}
		if r.deadWritersTmp(name) {
			os.Remove(r.path("tmp", name))
			continue
		}
		info, err := e.Info()
		if err == nil && time.Since(info.ModTime()) > r.o.StaleTmpAge {
			os.Remove(r.path("tmp", name))
		}
	}
}

// tmpPattern names a temp file after its writer (a tag of this host and the
// pid), so that a node restarted after a crash removes what its dead
// predecessor left at once, while files of live writers — other nodes sharing
// the repository, or other processes on this host — wait for StaleTmpAge.
func (r *Repo) tmpPattern(kind string) string {
	return fmt.Sprintf("%s-%s.%d-*", kind, r.hostTag(), os.Getpid())
}

// hostTag is a short hash of the host name: host names may hold the
// separators the temp name uses.
func (r *Repo) hostTag() string {
	h := fnv.New32a()
	h.Write([]byte(r.host))
	return fmt.Sprintf("%08x", h.Sum32())
}

// deadWritersTmp reports whether name is a temp file written by a process of
// this host that no longer runs.
func (r *Repo) deadWritersTmp(name string) bool {
	_, rest, ok := strings.Cut(name, "-")
	if !ok {
		return false
	}
	tag, rest, ok := strings.Cut(rest, ".")
	if !ok || tag != r.hostTag() {
		return false
	}
	pidStr, _, ok := strings.Cut(rest, "-")
	if !ok {
		return false
	}
	pid, err := strconv.Atoi(pidStr)
	return err == nil && pid > 0 && pid != os.Getpid() && !processAlive(pid)
}

// PutBlob implements repository.Repository.
func (r *Repo) PutBlob(ctx context.Context, d repository.Digest, size int64, src io.Reader) (repository.BlobInfo, error) {
	if err := d.Validate(); err != nil {
		return repository.BlobInfo{}, err
	}
	if src == nil {
		return repository.BlobInfo{}, fmt.Errorf("%w: nil reader for %s", repository.ErrInvalid, d)
	}
	final := r.blobPath(d)
	if info, err := r.touch(final, d, size); err == nil || !errors.Is(err, repository.ErrNotFound) {
		return info, err
	}
	f, err := os.CreateTemp(r.path("tmp"), r.tmpPattern("blob"))
	if err != nil {
		return repository.BlobInfo{}, fmt.Errorf("posixfs: %w", err)
	}
	tmp := f.Name()
	defer os.Remove(tmp) // after the link, or on failure
	v := repository.NewVerifier(d, size)
	_, err = io.Copy(io.MultiWriter(f, v), ctxReader{ctx, src})
	if err == nil {
		err = v.Check()
	}
	if err == nil {
		err = f.Chmod(0o444)
	}
	if err == nil {
		err = f.Sync()
	}
	if cerr := f.Close(); err == nil {
		err = cerr
	}
	if err != nil {
		return repository.BlobInfo{}, fmt.Errorf("posixfs: put %s: %w", d, err)
	}
	if err := os.Link(tmp, final); err != nil && !errors.Is(err, os.ErrExist) {
		// Filesystems without hard links: rename, which may replace an
		// identical copy a concurrent writer just published (harmless).
		if rerr := os.Rename(tmp, final); rerr != nil {
			return repository.BlobInfo{}, fmt.Errorf("posixfs: publish %s: %w", d, rerr)
		}
	}
	if err := syncDir(filepath.Dir(final)); err != nil {
		return repository.BlobInfo{}, err
	}
	return r.touch(final, d, size)
}

// touch refreshes a present blob's mtime (its LastUsed) and describes it.
func (r *Repo) touch(path string, d repository.Digest, size int64) (repository.BlobInfo, error) {
	now := time.Now()
	if err := os.Chtimes(path, now, now); err != nil {
		if errors.Is(err, os.ErrNotExist) {
			return repository.BlobInfo{}, fmt.Errorf("%w: blob %s", repository.ErrNotFound, d)
		}
		return repository.BlobInfo{}, fmt.Errorf("posixfs: %w", err)
	}
	info, err := r.StatBlob(context.Background(), d)
	if err == nil && size >= 0 && info.Size != size {
		return repository.BlobInfo{}, fmt.Errorf("%w: %s is stored with %d bytes, declared %d", repository.ErrDigestMismatch, d, info.Size, size)
	}
	return info, err
}

// GetBlob implements repository.Repository.
func (r *Repo) GetBlob(ctx context.Context, d repository.Digest) (io.ReadCloser, error) {
	f, size, err := r.openBlob(d)
	if err != nil {
		return nil, err
	}
	return repository.VerifyingReadCloser(f, d, size), nil
}

// OpenBlob implements repository.Repository.
func (r *Repo) OpenBlob(ctx context.Context, d repository.Digest) (repository.BlobReader, error) {
	f, size, err := r.openBlob(d)
	if err != nil {
		return nil, err
	}
	return &fileReader{f: f, size: size}, nil
}

func (r *Repo) openBlob(d repository.Digest) (*os.File, int64, error) {
	if err := d.Validate(); err != nil {
		return nil, 0, err
	}
	f, err := os.Open(r.blobPath(d))
	if errors.Is(err, os.ErrNotExist) {
		return nil, 0, fmt.Errorf("%w: blob %s", repository.ErrNotFound, d)
	}
	if err != nil {
		return nil, 0, fmt.Errorf("posixfs: %w", err)
	}
	st, err := f.Stat()
	if err != nil {
		f.Close()
		return nil, 0, fmt.Errorf("posixfs: %w", err)
	}
	return f, st.Size(), nil
}

// StatBlob implements repository.Repository.
func (r *Repo) StatBlob(ctx context.Context, d repository.Digest) (repository.BlobInfo, error) {
	if err := d.Validate(); err != nil {
		return repository.BlobInfo{}, err
	}
	st, err := os.Stat(r.blobPath(d))
	if errors.Is(err, os.ErrNotExist) {
		return repository.BlobInfo{}, fmt.Errorf("%w: blob %s", repository.ErrNotFound, d)
	}
	if err != nil {
		return repository.BlobInfo{}, fmt.Errorf("posixfs: %w", err)
	}
	return repository.BlobInfo{Digest: d, Size: st.Size(), LastUsed: st.ModTime()}, nil
}

// DeleteBlob implements repository.Repository.
func (r *Repo) DeleteBlob(ctx context.Context, d repository.Digest) error {
	if err := d.Validate(); err != nil {
		return err
	}
	if err := os.Remove(r.blobPath(d)); err != nil && !errors.Is(err, os.ErrNotExist) {
		return fmt.Errorf("posixfs: %w", err)
	}
	return syncDir(r.path("blobs", "sha256"))
}

// DeleteBlobIfUnused implements repository.Repository without a race
// window: the blob is first renamed aside (atomic, so a publisher touching
// it afterwards finds it missing and uploads a fresh copy), and only then is
// its mtime checked; a blob used since cutoff is linked back (no-clobber, so
// a fresh copy wins).
func (r *Repo) DeleteBlobIfUnused(ctx context.Context, d repository.Digest, cutoff time.Time) error {
	if err := d.Validate(); err != nil {
		return err
	}
	final := r.blobPath(d)
	aside := r.path("tmp", "gc-"+d.Hex()+"-"+newToken())
	if err := os.Rename(final, aside); err != nil {
		if errors.Is(err, os.ErrNotExist) {
			return fmt.Errorf("%w: blob %s", repository.ErrNotFound, d)
		}
		return fmt.Errorf("posixfs: %w", err)
	}
	defer os.Remove(aside)
	st, err := os.Stat(aside)
	if err != nil || !st.ModTime().Before(cutoff) {
		if lerr := os.Link(aside, final); lerr != nil && !errors.Is(lerr, os.ErrExist) {
			return fmt.Errorf("posixfs: restore %s: %w", d, lerr)
		}
		if err != nil {
			return fmt.Errorf("posixfs: stat %s: %w", d, err)
		}
		return fmt.Errorf("%w: %s used at %s", repository.ErrInUse, d, st.ModTime().UTC().Format(time.RFC3339Nano))
	}
	return syncDir(filepath.Dir(final))
}

// WalkBlobs implements repository.Repository.
func (r *Repo) WalkBlobs(ctx context.Context, fn func(repository.BlobInfo) error) error {
	ents, err := os.ReadDir(r.path("blobs", "sha256"))
	if err != nil {
		return fmt.Errorf("posixfs: %w", err)
	}
	for _, e := range ents {
		if err := ctx.Err(); err != nil {
			return err
		}
		d := repository.Digest("sha256:" + e.Name())
		if d.Validate() != nil {
			continue
		}
		info, err := e.Info()
		if errors.Is(err, os.ErrNotExist) {
			continue
		}
		if err != nil {
			return fmt.Errorf("posixfs: %w", err)
		}
		if err := fn(repository.BlobInfo{Digest: d, Size: info.Size(), LastUsed: info.ModTime()}); err != nil {
			return err
		}
	}
	return nil
}

// writeFileAtomic writes b to path via a temp file in tmp/, fsync, rename
// and a parent directory fsync, so a crash leaves the old or the new file.
func (r *Repo) writeFileAtomic(path string, b []byte) error {
	f, err := os.CreateTemp(r.path("tmp"), r.tmpPattern("rec"))
	if err != nil {
		return fmt.Errorf("posixfs: %w", err)
	}
	tmp := f.Name()
	_, err = f.Write(b)
	if err == nil {
		err = f.Chmod(0o644)
	}
	if err == nil {
		err = f.Sync()
	}
	if cerr := f.Close(); err == nil {
		err = cerr
	}
	if err == nil {
		err = os.Rename(tmp, path)
	}
	if err != nil {
		os.Remove(tmp)
		return fmt.Errorf("posixfs: write %s: %w", path, err)
	}
	return syncDir(filepath.Dir(path))
}

func syncDir(dir string) error {
	f, err := os.Open(dir)
	if err != nil {
		return fmt.Errorf("posixfs: %w", err)
	}
	defer f.Close()
	// Some network filesystems refuse fsync on directories; their rename is
	// synchronous on the server anyway.
	if err := f.Sync(); err != nil && !errors.Is(err, syscall.EINVAL) && !errors.Is(err, syscall.ENOTSUP) {
		return fmt.Errorf("posixfs: fsync %s: %w", dir, err)
	}
	return nil
}

type fileReader struct {
	f    *os.File
	size int64
}

func (fr *fileReader) ReadAt(ctx context.Context, p []byte, off int64) (int, error) {
	if off < 0 {
		return 0, fmt.Errorf("%w: negative offset %d", repository.ErrInvalid, off)
	}
	return fr.f.ReadAt(p, off)
}

func (fr *fileReader) Size() int64  { return fr.size }
func (fr *fileReader) Close() error { return fr.f.Close() }

// ctxReader stops a long copy when ctx is cancelled.
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
