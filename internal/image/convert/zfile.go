package convert

import (
	"fmt"
	"os"

	"github.com/aenv-dev/aenv/internal/storage/lsmt"
	"github.com/aenv-dev/aenv/internal/storage/zfile"
)

// zw is where committed layer bytes go: a ZFile writer over the output file.
type zw = zfile.Writer

// writeZFile creates out and lets fill write an LSMT layer into it through
// a ZFile (LZ4, 4 KiB blocks, checksummed) compressor.
func writeZFile(out string, fill func(w *zw) error) error {
	f, err := os.OpenFile(out, os.O_CREATE|os.O_EXCL|os.O_WRONLY, 0o644)
	if err != nil {
		return err
	}
	z, err := zfile.NewWriter(f, zfile.WriterOptions{})
	if err == nil {
		err = fill(z)
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
		return fmt.Errorf("write %s: %w", out, err)
	}
	return nil
}

// compressSealed rewrites the sealed layer at sealed as a committed,
// ZFile-compressed layer at out, keeping its UUID and parent: a sealed
// upper still holds every overwritten block, a committed layer only the
// live ones.
func compressSealed(sealed, out, uuid string) error {
	f, err := os.Open(sealed)
	if err != nil {
		return err
	}
	defer f.Close()
	fi, err := f.Stat()
	if err != nil {
		return err
	}
	l, err := lsmt.OpenLayer(f, fi.Size(), sealed)
	if err != nil {
		return fmt.Errorf("open sealed layer: %w", err)
	}
	return writeZFile(out, func(w *zw) error {
		_, err := lsmt.Commit(w, lsmt.CommitSource{Mappings: l.Index().Mappings(), VirtualSize: l.VirtualSize(),
			Read: func(_ uint8, p []byte, off int64) error { return l.ReadPhysical(p, off) }},
			lsmt.CommitOptions{UUID: uuid, ParentUUID: l.Trailer().ParentUUID})
		return err
	})
}
