package image

import (
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
)

// ErrMissingTool means a host program the conversion needs is not installed.
var ErrMissingTool = errors.New("required tool missing")

// BuildExt4 makes an ext4 filesystem image of sizeMB MiB at out, populated
// from rootfsDir (ownership, modes, links, device nodes and xattrs as they
// are) with mkfs.ext4 -d (e2fsprogs >= 1.43). An empty rootfsDir ("") gives
// an empty filesystem. The file is sparse; out is replaced atomically and
// must not be a directory.
func BuildExt4(ctx context.Context, rootfsDir, out string, sizeMB int) error {
	if sizeMB < 8 {
		return fmt.Errorf("ext4 image: size %d MiB is too small (at least 8)", sizeMB)
	}
	mkfs, err := exec.LookPath("mkfs.ext4")
	if err != nil {
		return fmt.Errorf("%w: mkfs.ext4 (install e2fsprogs): %w", ErrMissingTool, err)
	}
	tmp, err := os.CreateTemp(filepath.Dir(out), "."+filepath.Base(out)+".tmp-")
	if err != nil {
		return fmt.Errorf("ext4 image: %w", err)
	}
	defer os.Remove(tmp.Name())
	err = tmp.Truncate(int64(sizeMB) << 20)
	if cerr := tmp.Close(); err == nil {
		err = cerr
	}
	if err != nil {
		return fmt.Errorf("ext4 image: %w", err)
	}
	args := []string{"-q", "-F", "-t", "ext4", "-b", "4096", "-L", "aenv-root",
		"-E", "root_owner=0:0,lazy_itable_init=1,lazy_journal_init=1,nodiscard"}
	if rootfsDir != "" {
		args = append(args, "-d", rootfsDir)
	}
	args = append(args, tmp.Name())
	if b, err := exec.CommandContext(ctx, mkfs, args...).CombinedOutput(); err != nil {
		return fmt.Errorf("mkfs.ext4 %s: %w: %s", rootfsDir, err, b)
	}
	if err := os.Rename(tmp.Name(), out); err != nil {
		return fmt.Errorf("ext4 image: %w", err)
	}
	return nil
}
