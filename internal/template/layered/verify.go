package layered

import (
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"os"

	"github.com/aenv-dev/aenv/internal/storage/blockdev"
	"github.com/aenv-dev/aenv/internal/storage/stack"
)

// ErrNotExt4 means a layered template's device holds no ext4 filesystem.
var ErrNotExt4 = errors.New("layered: device holds no ext4 filesystem")

// ext4 superblock: 1024 bytes in, magic 0xEF53 (little-endian) at offset 56 of it.
const (
	superblockOffset = 1024
	magicOffset      = superblockOffset + 56
	ext4Magic        = 0xEF53
)

// Verify opens the stack the manifest at path describes and exposes it the way sandbox
// roots are (FUSE file, loop device; read-only here), then reads the ext4 superblock from
// the loop device. It proves both that this host can run layered roots (root, /dev/fuse,
// loop devices) and that the layer reads back, so a node can fall back to a directory
// template before any sandbox fails. Everything it sets up is released before it returns;
// what a crash during an earlier Verify left under workDir is swept first.
func Verify(ctx context.Context, path, workDir string) (err error) {
	if err := blockdev.Sweep(ctx, workDir); err != nil {
		return fmt.Errorf("layered: verify: %w", err)
	}
	m, err := stack.LoadManifest(path)
	if err != nil {
		return fmt.Errorf("layered: verify: %w", err)
	}
	st, err := stack.Open(ctx, m, stack.Options{})
	if err != nil {
		return fmt.Errorf("layered: verify: %w", err)
	}
	defer func() { err = errors.Join(err, st.Close()) }()
	ex, err := blockdev.Expose(ctx, workDir, st, blockdev.MountOptions{ReadOnly: true})
	if err != nil {
		return fmt.Errorf("layered: verify: expose: %w", err)
	}
	defer func() { err = errors.Join(err, ex.Close()) }()
	dev, err := os.Open(ex.Device())
	if err != nil {
		return fmt.Errorf("layered: verify: %w", err)
	}
	defer dev.Close()
	var b [2]byte
	if _, err := dev.ReadAt(b[:], magicOffset); err != nil {
		return fmt.Errorf("layered: verify: read %s: %w", ex.Device(), err)
	}
	if binary.LittleEndian.Uint16(b[:]) != ext4Magic {
		return fmt.Errorf("%w (%s)", ErrNotExt4, path)
	}
	return nil
}
