package unpack

import (
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path"
	"strings"
)

// maxSymlinks bounds symlink expansion while resolving one path, like the
// kernel's ELOOP limit, so a cycle of links cannot spin forever.
const maxSymlinks = 255

// ErrUnsafePath marks an entry whose name or link target could address
// something outside the root (absolute, or with ".." components).
var ErrUnsafePath = errors.New("unsafe path in layer")

// cleanName turns a tar entry name into a root-relative path. Names are
// relative ("etc/passwd", "./etc/passwd"); absolute names and ".." components
// are refused rather than clamped, because a well-formed layer never has them
// and a layer that does is more likely hostile than sloppy.
func cleanName(name string) (string, error) {
	if name == "" {
		return "", fmt.Errorf("%w: empty name", ErrUnsafePath)
	}
	if strings.HasPrefix(name, "/") {
		return "", fmt.Errorf("%w: absolute name %q", ErrUnsafePath, name)
	}
	if strings.IndexByte(name, 0) >= 0 {
		return "", fmt.Errorf("%w: NUL in name %q", ErrUnsafePath, name)
	}
	for _, c := range strings.Split(name, "/") {
		if c == ".." {
			return "", fmt.Errorf("%w: %q has a .. component", ErrUnsafePath, name)
		}
	}
	p := path.Clean(name)
	if p == "." {
		return "", nil
	}
	return p, nil
}

// resolveDir resolves rel (clean, relative) inside root with chroot
// semantics: every component is looked up without following it out of root;
// a symlink is expanded as if root were "/" (absolute targets restart at
// root, ".." stops at root). The result names the same directory with no
// symlinks in it, so operations on it cannot leave root. Components that do
// not exist are kept as they are (the caller creates them).
func resolveDir(root *os.Root, rel string) (string, error) {
	var done []string
	todo := splitPath(rel)
	hops := 0
	for len(todo) > 0 {
		c := todo[0]
		todo = todo[1:]
		switch c {
		case "", ".":
			continue
		case "..":
			if len(done) > 0 {
				done = done[:len(done)-1]
			}
			continue
		}
		cur := path.Join(append(done, c)...)
		fi, err := root.Lstat(cur)
		if errors.Is(err, fs.ErrNotExist) {
			// Nothing below a missing component can exist either.
			done = append(done, c)
			for _, r := range todo {
				if r == ".." {
					return "", fmt.Errorf("%w: %q walks .. through a missing directory", ErrUnsafePath, rel)
				}
			}
			done = append(done, filterDots(todo)...)
			break
		}
		if err != nil {
			return "", err
		}
		if fi.Mode()&fs.ModeSymlink == 0 {
			done = append(done, c)
			continue
		}
		hops++
		if hops > maxSymlinks {
			return "", fmt.Errorf("resolve %q: too many levels of symbolic links", rel)
		}
		target, err := root.Readlink(cur)
		if err != nil {
			return "", err
		}
		if strings.HasPrefix(target, "/") {
			done = done[:0]
		}
		todo = append(splitPath(target), todo...)
	}
	return path.Join(done...), nil
}

func splitPath(p string) []string {
	return strings.Split(strings.Trim(p, "/"), "/")
}

func filterDots(cs []string) []string {
	out := cs[:0:0]
	for _, c := range cs {
		if c != "" && c != "." {
			out = append(out, c)
		}
	}
	return out
}

// Resolve resolves rel inside root as a process chrooted into root would (symlinks
// expanded, absolute targets restarting at root, ".." stopping there) and returns the
// root-relative path with no symlink in it. Components that do not exist are kept.
func Resolve(root *os.Root, rel string) (string, error) {
	return resolveDir(root, strings.TrimPrefix(path.Clean("/"+rel), "/"))
}
