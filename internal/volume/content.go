package volume

import (
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"path"
	"strings"
	"syscall"
	"time"
)

// DefaultUID and DefaultGID own what the content API makes unless told otherwise: the
// sandboxes' default user ("user", 1000:1000), so code in a sandbox may change it.
const (
	DefaultUID = 1000
	DefaultGID = 1000
)

// Errors of the content API beyond ErrNotFound and ErrInvalid.
var (
	ErrPathNotFound = errors.New("path not found in volume") // 404
	ErrIsDir        = errors.New("path is a directory")      // 400
	ErrPathExists   = errors.New("path already exists")      // 409
)

// Entry is E2B's VolumeEntryStat.
type Entry struct {
	Name   string    `json:"name"`
	Path   string    `json:"path"`
	Type   string    `json:"type"` // "file" | "directory" | "symlink" | "unknown"
	Size   int64     `json:"size"`
	Mode   uint32    `json:"mode"`
	UID    uint32    `json:"uid"`
	GID    uint32    `json:"gid"`
	Atime  time.Time `json:"atime"`
	Mtime  time.Time `json:"mtime"`
	Ctime  time.Time `json:"ctime"`
	Target string    `json:"target,omitempty"`
}

// Owner is the optional ownership and mode of a write.
type Owner struct {
	UID, GID *uint32
	Mode     *uint32
}

// Content is one volume's files, confined to its directory: a path that leaves it, through
// ".." or a symbolic link, is refused by the kernel-checked os.Root.
type Content struct {
	root *os.Root
}

// Open opens volume id's content; the caller closes it.
func (s *Store) Open(id string) (*Content, error) {
	r, err := os.OpenRoot(s.dataDir(id))
	if err != nil {
		return nil, fmt.Errorf("volume: open %s: %w", id, err)
	}
	return &Content{root: r}, nil
}

// Close releases the content handle.
func (c *Content) Close() error { return c.root.Close() }

// rel turns an API path ("/a/b", "a/b", "" or "/") into a path relative to the root.
func rel(p string) (string, error) {
	if strings.ContainsRune(p, 0) {
		return "", fmt.Errorf("%w: path contains NUL", ErrInvalid)
	}
	c := path.Clean("/" + p)
	if c == "/" {
		return ".", nil
	}
	return strings.TrimPrefix(c, "/"), nil
}

func apiPath(r string) string {
	if r == "." {
		return "/"
	}
	return "/" + r
}

func mapErr(p string, err error) error {
	switch {
	case err == nil:
		return nil
	case errors.Is(err, fs.ErrNotExist):
		return fmt.Errorf("%w: %s", ErrPathNotFound, p)
	case errors.Is(err, fs.ErrExist):
		return fmt.Errorf("%w: %s", ErrPathExists, p)
	case errors.Is(err, syscall.EISDIR):
		return fmt.Errorf("%w: %s", ErrIsDir, p)
	case errors.Is(err, syscall.ENOSPC), errors.Is(err, syscall.EDQUOT):
		return fmt.Errorf("%w: writing %s: the volume's size quota is used up", ErrNoSpace, p)
	case errors.Is(err, syscall.ENOTDIR), errors.Is(err, syscall.ENOTEMPTY):
		return fmt.Errorf("%w: %s: %v", ErrInvalid, p, err)
	case strings.Contains(err.Error(), "path escapes"):
		return fmt.Errorf("%w: %s leaves the volume", ErrInvalid, p)
	}
	return err
}

// Stat describes the entry at p (not following a final symbolic link).
func (c *Content) Stat(p string) (Entry, error) {
	r, err := rel(p)
	if err != nil {
		return Entry{}, err
	}
	fi, err := c.root.Lstat(r)
	if err != nil {
		return Entry{}, mapErr(p, err)
	}
	return c.entry(r, fi), nil
}

func (c *Content) entry(r string, fi fs.FileInfo) Entry {
	e := Entry{Name: path.Base(apiPath(r)), Path: apiPath(r), Size: fi.Size(), Mtime: fi.ModTime().UTC()}
	switch {
	case fi.Mode().IsRegular():
		e.Type = "file"
	case fi.IsDir():
		e.Type = "directory"
	case fi.Mode()&fs.ModeSymlink != 0:
		e.Type = "symlink"
		e.Target, _ = c.root.Readlink(r)
	default:
		e.Type = "unknown"
	}
	if st, ok := fi.Sys().(*syscall.Stat_t); ok {
		e.Mode = st.Mode & 0o7777
		e.UID, e.GID = st.Uid, st.Gid
		e.Atime = time.Unix(st.Atim.Sec, st.Atim.Nsec).UTC()
		e.Ctime = time.Unix(st.Ctim.Sec, st.Ctim.Nsec).UTC()
	}
	return e
}

// List lists the directory p, descending depth levels (1: its entries only).
func (c *Content) List(p string, depth int) ([]Entry, error) {
	r, err := rel(p)
	if err != nil {
		return nil, err
	}
	if depth < 1 {
		depth = 1
	}
	fi, err := c.root.Lstat(r)
	if err != nil {
		return nil, mapErr(p, err)
	}
	if !fi.IsDir() {
		return nil, fmt.Errorf("%w: %s is not a directory", ErrInvalid, p)
	}
	out := []Entry{}
	err = c.walk(r, depth, &out)
	return out, mapErr(p, err)
}

func (c *Content) walk(r string, depth int, out *[]Entry) error {
	d, err := c.root.Open(r)
	if err != nil {
		return err
	}
	ents, err := d.ReadDir(-1)
	d.Close()
	if err != nil {
		return err
	}
	for _, de := range ents {
		child := path.Join(r, de.Name())
		fi, err := de.Info()
		if err != nil {
			continue // removed meanwhile
		}
		*out = append(*out, c.entry(child, fi))
		if depth > 1 && fi.IsDir() {
			if err := c.walk(child, depth-1, out); err != nil {
				return err
			}
		}
	}
	return nil
}

// MakeDir creates directory p (and its parents when parents is set).
func (c *Content) MakeDir(p string, parents bool, o Owner) (Entry, error) {
	r, err := rel(p)
	if err != nil {
		return Entry{}, err
	}
	if r == "." {
		return Entry{}, fmt.Errorf("%w: the volume's root exists", ErrPathExists)
	}
	if parents {
		err = c.root.MkdirAll(r, 0o755)
	} else {
		err = c.root.Mkdir(r, 0o755)
	}
	if err != nil {
		return Entry{}, mapErr(p, err)
	}
	if err := c.apply(r, o, 0o755); err != nil {
		return Entry{}, err
	}
	return c.Stat(p)
}

// apply sets ownership (default DefaultUID:DefaultGID) and mode (default def) of r.
func (c *Content) apply(r string, o Owner, def uint32) error {
	uid, gid, mode := uint32(DefaultUID), uint32(DefaultGID), def
	if o.UID != nil {
		uid = *o.UID
	}
	if o.GID != nil {
		gid = *o.GID
	}
	if o.Mode != nil {
		mode = *o.Mode
	}
	return c.setattr(r, &uid, &gid, &mode)
}

func (c *Content) setattr(r string, uid, gid, mode *uint32) error {
	if mode != nil {
		if *mode > 0o7777 {
			return fmt.Errorf("%w: mode %o is not a permission mode", ErrInvalid, *mode)
		}
		fm := fs.FileMode(*mode & 0o777)
		if *mode&0o4000 != 0 {
			fm |= fs.ModeSetuid
		}
		if *mode&0o2000 != 0 {
			fm |= fs.ModeSetgid
		}
		if *mode&0o1000 != 0 {
			fm |= fs.ModeSticky
		}
		if err := c.root.Chmod(r, fm); err != nil {
			return mapErr(apiPath(r), err)
		}
	}
	if uid != nil || gid != nil {
		u, g := -1, -1
		if uid != nil {
			u = int(*uid)
		}
		if gid != nil {
			g = int(*gid)
		}
		if err := c.root.Lchown(r, u, g); err != nil {
			return mapErr(apiPath(r), err)
		}
	}
	return nil
}

// SetAttr changes the ownership or mode of p.
func (c *Content) SetAttr(p string, uid, gid, mode *uint32) (Entry, error) {
	r, err := rel(p)
	if err != nil {
		return Entry{}, err
	}
	if _, err := c.root.Lstat(r); err != nil {
		return Entry{}, mapErr(p, err)
	}
	if err := c.setattr(r, uid, gid, mode); err != nil {
		return Entry{}, err
	}
	return c.Stat(p)
}

// Remove removes p, recursively for a directory. The root cannot be removed.
func (c *Content) Remove(p string) error {
	r, err := rel(p)
	if err != nil {
		return err
	}
	if r == "." {
		return fmt.Errorf("%w: the volume's root cannot be removed (delete the volume)", ErrInvalid)
	}
	if _, err := c.root.Lstat(r); err != nil {
		return mapErr(p, err)
	}
	return mapErr(p, c.root.RemoveAll(r))
}

// OpenFile opens the regular file p for reading.
func (c *Content) OpenFile(p string) (*os.File, fs.FileInfo, error) {
	r, err := rel(p)
	if err != nil {
		return nil, nil, err
	}
	f, err := c.root.Open(r)
	if err != nil {
		return nil, nil, mapErr(p, err)
	}
	fi, err := f.Stat()
	if err != nil {
		f.Close()
		return nil, nil, err
	}
	if fi.IsDir() {
		f.Close()
		return nil, nil, fmt.Errorf("%w: %s", ErrIsDir, p)
	}
	return f, fi, nil
}

// WriteFile writes body to p, creating its parent directories and replacing the file
// atomically (a reader in a sandbox sees the old content or the new, never a mix).
func (c *Content) WriteFile(p string, body io.Reader, o Owner) (Entry, error) {
	r, err := rel(p)
	if err != nil {
		return Entry{}, err
	}
	if r == "." {
		return Entry{}, fmt.Errorf("%w: /", ErrIsDir)
	}
	if fi, err := c.root.Lstat(r); err == nil && fi.IsDir() {
		return Entry{}, fmt.Errorf("%w: %s", ErrIsDir, p)
	}
	if dir := path.Dir(r); dir != "." {
		if err := c.root.MkdirAll(dir, 0o755); err != nil {
			return Entry{}, mapErr(p, err)
		}
	}
	tmp := path.Join(path.Dir(r), fmt.Sprintf(".%s.aenv-upload-%d", path.Base(r), time.Now().UnixNano()))
	f, err := c.root.OpenFile(tmp, os.O_CREATE|os.O_EXCL|os.O_WRONLY, 0o644)
	if err != nil {
		return Entry{}, mapErr(p, err)
	}
	_, err = io.Copy(f, body)
	if cerr := f.Close(); err == nil {
		err = cerr
	}
	err = mapErr(p, err)
	if err == nil {
		err = c.apply(tmp, o, 0o644)
	}
	if err == nil {
		err = mapErr(p, c.root.Rename(tmp, r))
	}
	if err != nil {
		_ = c.root.Remove(tmp)
		return Entry{}, err
	}
	return c.Stat(p)
}
