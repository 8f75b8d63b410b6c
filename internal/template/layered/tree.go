package layered

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"syscall"
)

// TreeHash identifies a directory tree's version from its metadata: every entry's path,
// type and permission bits, owner, size, modification time, device number and symlink
// target, in lexical order. File contents are not read (a rebuilt tree has new mtimes),
// so it costs one lstat per entry.
func TreeHash(ctx context.Context, root string) (string, error) {
	h := sha256.New()
	err := filepath.WalkDir(root, func(p string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		if err := ctx.Err(); err != nil {
			return err
		}
		rel, err := filepath.Rel(root, p)
		if err != nil {
			return err
		}
		fi, err := d.Info()
		if err != nil {
			return err
		}
		st, ok := fi.Sys().(*syscall.Stat_t)
		if !ok {
			return fmt.Errorf("%s: no stat data", p)
		}
		link := ""
		if fi.Mode()&fs.ModeSymlink != 0 {
			if link, err = os.Readlink(p); err != nil {
				return err
			}
		}
		size := fi.Size()
		if fi.IsDir() {
			size = 0 // a directory's size depends on its history, not its content
		}
		fmt.Fprintf(h, "%q %o %d:%d %d %d %d %q\n", rel, uint32(fi.Mode()), st.Uid, st.Gid, size,
			fi.ModTime().UnixNano(), st.Rdev, link)
		return nil
	})
	if err != nil {
		return "", fmt.Errorf("layered: hash %s: %w", root, err)
	}
	return hex.EncodeToString(h.Sum(nil)), nil
}
