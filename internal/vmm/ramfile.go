package vmm

import (
	"errors"
	"fmt"
	"io"
	"os"

	"golang.org/x/sys/unix"
)

// The RAM-file rules (see the package doc):
//   - a template RAM file is immutable: MarkTemplate drops its write permission, and Start
//     refuses to map such a file shared;
//   - forks map it private (Memory{Share: false}): copy-on-write, the file never changes;
//   - a sandbox that must pause cheaply runs shared on its own copy (CopyRAMFile), so its
//     pause is a 7 ms device-state save.

// MarkTemplate makes a stopped VM's RAM file a template: read-only from now on. QEMU 7.2
// still opens a private mapping's file read-write (a later QEMU does not), so the mode is
// the marker Start checks, not a kernel-enforced lock against root.
func MarkTemplate(path string) error {
	if err := os.Chmod(path, 0o444); err != nil {
		return fmt.Errorf("vmm: mark RAM template: %w", err)
	}
	return nil
}

// CopyRAMFile copies a RAM file to dst (created writable), keeping holes: pages the guest
// never touched cost neither time nor memory. dst appears complete or not at all.
func CopyRAMFile(src, dst string) (err error) {
	in, err := os.Open(src)
	if err != nil {
		return fmt.Errorf("vmm: copy RAM file: %w", err)
	}
	defer in.Close()
	st, err := in.Stat()
	if err != nil {
		return fmt.Errorf("vmm: copy RAM file: %w", err)
	}
	tmp := dst + ".partial"
	out, err := os.OpenFile(tmp, os.O_CREATE|os.O_TRUNC|os.O_WRONLY, 0o600)
	if err != nil {
		return fmt.Errorf("vmm: copy RAM file: %w", err)
	}
	defer func() {
		if cerr := out.Close(); err == nil && cerr != nil {
			err = fmt.Errorf("vmm: copy RAM file: %w", cerr)
		}
		if err != nil {
			os.Remove(tmp)
			return
		}
		if rerr := os.Rename(tmp, dst); rerr != nil {
			os.Remove(tmp)
			err = fmt.Errorf("vmm: copy RAM file: %w", rerr)
		}
	}()
	if err := out.Truncate(st.Size()); err != nil {
		return fmt.Errorf("vmm: copy RAM file: %w", err)
	}
	return copyData(in, out, st.Size())
}

// copyData copies the data extents of in (SEEK_DATA/SEEK_HOLE) into the same offsets of
// out, which is already sized.
func copyData(in, out *os.File, size int64) error {
	fdIn := int(in.Fd())
	for off := int64(0); off < size; {
		data, err := unix.Seek(fdIn, off, unix.SEEK_DATA)
		if errors.Is(err, unix.ENXIO) {
			return nil // only a hole remains
		}
		if err != nil {
			return fmt.Errorf("vmm: copy RAM file: seek data: %w", err)
		}
		hole, err := unix.Seek(fdIn, data, unix.SEEK_HOLE)
		if err != nil {
			return fmt.Errorf("vmm: copy RAM file: seek hole: %w", err)
		}
		if _, err := out.Seek(data, io.SeekStart); err != nil {
			return fmt.Errorf("vmm: copy RAM file: %w", err)
		}
		if _, err := in.Seek(data, io.SeekStart); err != nil {
			return fmt.Errorf("vmm: copy RAM file: %w", err)
		}
		if _, err := io.CopyN(out, in, hole-data); err != nil {
			return fmt.Errorf("vmm: copy RAM file: %w", err)
		}
		off = hole
	}
	return nil
}
