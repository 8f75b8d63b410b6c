// Package blob opens an overlaybd layer blob as a read-only LSMT layer,
// peeling its optional encodings: tar wrapper, then ZFile, then LSMT
// (reference section 0).
package blob

import (
	"bytes"
	"fmt"
	"io"

	"github.com/aenv-dev/aenv/internal/storage/lsmt"
	"github.com/aenv-dev/aenv/internal/storage/tarwrap"
	"github.com/aenv-dev/aenv/internal/storage/zfile"
)

// Layer is an opened blob: the sealed LSMT layer plus what wrapped it.
type Layer struct {
	*lsmt.Layer
	Tar   *tarwrap.Info // nil when the blob is not tar-wrapped
	ZFile *zfile.Reader // nil when the payload is not a ZFile
}

// Open parses the blob in r (size bytes). name appears in errors.
func Open(r io.ReaderAt, size int64, name string) (*Layer, error) {
	payload, info, err := tarwrap.Open(r, size)
	if err != nil {
		return nil, fmt.Errorf("%s: %w", name, err)
	}
	out := &Layer{Tar: info}
	var src io.ReaderAt = payload
	srcSize := payload.Size()
	head := make([]byte, zfile.HeaderSize)
	// Anything with the ZFile magic is parsed as one, so a damaged ZFile
	// reports its own error rather than "not an LSMT layer".
	if n, _ := payload.ReadAt(head, 0); n >= 8 && bytes.HasPrefix(head, []byte("ZFile\x00\x01\x00")) {
		z, err := zfile.Open(payload, payload.Size(), name)
		if err != nil {
			return nil, err
		}
		out.ZFile = z
		src, srcSize = z, z.Size()
	}
	l, err := lsmt.OpenLayer(src, srcSize, name)
	if err != nil {
		if out.ZFile != nil {
			out.ZFile.Close()
		}
		return nil, err
	}
	out.Layer = l
	return out, nil
}

// Close releases decoder resources; it does not close r.
func (l *Layer) Close() error {
	if l.ZFile != nil {
		return l.ZFile.Close()
	}
	return nil
}
