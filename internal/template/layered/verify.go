package layered

import (
	"context"
	"encoding/binary"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"reflect"
	"strings"

	"golang.org/x/sys/unix"

	"github.com/aenv-dev/aenv/internal/atomicfile"

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

// verifiedFile records the last Verify that passed, next to the manifest it checked.
const verifiedFile = ".verified"

// verifiedKey is what a passed Verify depends on: the boot (a reboot may bring a kernel
// without FUSE or loop devices, or another /dev), the manifest and the identity of every
// layer file it names (a rewritten or replaced layer changes its inode, size or mtime).
type verifiedKey struct {
	BootID   string   `json:"boot_id"`
	Manifest string   `json:"manifest"`
	Layers   []string `json:"layers"`
}

// VerifyOnce is Verify, skipped when a Verify of the same manifest, layer files and boot
// already passed. A node restart then pays nothing for a check that can only give the
// same answer (Verify mounts the stack through FUSE and a loop device, ~0.5 s on a busy
// host, per built-in template); anything it depends on that changed checks again.
func VerifyOnce(ctx context.Context, path, workDir string) error {
	stamp := filepath.Join(filepath.Dir(path), verifiedFile)
	key, kerr := verifiedKeyOf(path)
	if kerr == nil {
		if raw, err := os.ReadFile(stamp); err == nil {
			var old verifiedKey
			if json.Unmarshal(raw, &old) == nil && reflect.DeepEqual(old, key) {
				return nil
			}
		}
	}
	os.Remove(stamp)
	if err := Verify(ctx, path, workDir); err != nil {
		return err
	}
	if kerr != nil {
		return nil // checked, but nothing to remember it by
	}
	raw, err := json.Marshal(key)
	if err != nil {
		return nil
	}
	// Losing the stamp only costs the next start a Verify.
	_ = atomicfile.WriteFile(stamp, raw, 0o644)
	return nil
}

func verifiedKeyOf(path string) (verifiedKey, error) {
	boot, err := os.ReadFile("/proc/sys/kernel/random/boot_id")
	if err != nil {
		return verifiedKey{}, err
	}
	abs, err := filepath.Abs(path)
	if err != nil {
		return verifiedKey{}, err
	}
	m, err := stack.LoadManifest(path)
	if err != nil {
		return verifiedKey{}, err
	}
	k := verifiedKey{BootID: strings.TrimSpace(string(boot)), Manifest: abs}
	for _, l := range m.Lowers {
		var st unix.Stat_t
		if err := unix.Stat(l.Path, &st); err != nil {
			return verifiedKey{}, err
		}
		k.Layers = append(k.Layers, fmt.Sprintf("%s:%d:%d:%d:%d", l.Path, st.Dev, st.Ino, st.Size, st.Mtim.Nano()))
	}
	return k, nil
}
