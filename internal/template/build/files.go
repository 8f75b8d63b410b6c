package build

import (
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"path/filepath"
)

// ErrTooLarge means an upload exceeded the configured limit.
var ErrTooLarge = errors.New("upload too large")

// fileStore keeps uploaded COPY file sets, named by the hash the SDK computed over
// their paths, modes and contents (E2B's filesHash), so a rebuild with unchanged files
// skips the upload.
type fileStore struct {
	dir   string
	limit int64
}

func openFileStore(dir string, limit int64) (*fileStore, error) {
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return nil, fmt.Errorf("build uploads: %w", err)
	}
	return &fileStore{dir: dir, limit: limit}, nil
}

func (f *fileStore) path(hash string) string { return filepath.Join(f.dir, hash+".tar") }

func (f *fileStore) has(hash string) bool {
	if !ValidHash(hash) {
		return false
	}
	fi, err := os.Stat(f.path(hash))
	return err == nil && fi.Mode().IsRegular()
}

// Present reports whether the file set is already on the node.
func (f *fileStore) Present(hash string) (bool, error) {
	if !ValidHash(hash) {
		return false, fmt.Errorf("%w: files hash %q", ErrInvalidSpec, hash)
	}
	return f.has(hash), nil
}

// Open opens an uploaded file set.
func (f *fileStore) Open(hash string) (io.ReadCloser, error) {
	if !ValidHash(hash) {
		return nil, fmt.Errorf("%w: files hash %q", ErrInvalidSpec, hash)
	}
	r, err := os.Open(f.path(hash))
	if errors.Is(err, fs.ErrNotExist) {
		return nil, fmt.Errorf("files %s: %w (upload them first)", hash, ErrNotFound)
	}
	return r, err
}

// Put stores an upload: a tar, optionally gzipped. It is checked to be a readable tar
// before it becomes visible, so a truncated or foreign upload fails here and not in a
// build. Nothing is kept on error.
func (f *fileStore) Put(hash string, r io.Reader) error {
	if !ValidHash(hash) {
		return fmt.Errorf("%w: files hash %q", ErrInvalidSpec, hash)
	}
	tmp, err := os.CreateTemp(f.dir, ".upload-*")
	if err != nil {
		return err
	}
	ok := false
	defer func() {
		tmp.Close()
		if !ok {
			os.Remove(tmp.Name())
		}
	}()
	n, err := io.Copy(tmp, io.LimitReader(r, f.limit+1))
	if err != nil {
		return fmt.Errorf("receive upload: %w", err)
	}
	if n > f.limit {
		return fmt.Errorf("%w: more than %d bytes", ErrTooLarge, f.limit)
	}
	if _, err := tmp.Seek(0, io.SeekStart); err != nil {
		return err
	}
	if err := checkTar(tmp); err != nil {
		return fmt.Errorf("%w: %w", ErrInvalidSpec, err)
	}
	if err := tmp.Close(); err != nil {
		return err
	}
	if err := os.Rename(tmp.Name(), f.path(hash)); err != nil {
		return err
	}
	ok = true
	return nil
}

func checkTar(r io.Reader) error {
	tr, err := openUpload(r)
	if err != nil {
		return err
	}
	n := 0
	for {
		_, err := tr.Next()
		if errors.Is(err, io.EOF) {
			break
		}
		if err != nil {
			return fmt.Errorf("upload is not a tar archive: %w", err)
		}
		if _, err := io.Copy(io.Discard, tr); err != nil {
			return fmt.Errorf("upload is truncated: %w", err)
		}
		n++
	}
	if n == 0 {
		return errors.New("upload holds no files")
	}
	return nil
}
