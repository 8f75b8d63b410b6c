package filesystem

import (
	"bytes"
	"errors"
	"fmt"
	"os"
	"strings"

	"golang.org/x/sys/unix"
)

// File metadata (envd >= 0.6.2) is stored as user extended attributes in E2B's namespace:
// metadata key k is the xattr "user.e2b.k", so other tools' user.* attributes are neither
// reported nor cleared. Keys are HTTP header tokens (lower-cased, since header names are not
// case-preserving); values are printable ASCII.
const xattrPrefix = "user.e2b."

// ErrMetadataUnsupported is returned when the filesystem does not support user xattrs.
var ErrMetadataUnsupported = errors.New("the filesystem does not support file metadata (user extended attributes)")

// ValidMetadataKey reports whether k is a non-empty HTTP token.
func ValidMetadataKey(k string) bool {
	if k == "" || len(k) > 200 {
		return false
	}
	for i := 0; i < len(k); i++ {
		c := k[i]
		if !(c >= 'a' && c <= 'z' || c >= 'A' && c <= 'Z' || c >= '0' && c <= '9' || strings.IndexByte("!#$%&'*+-.^_`|~", c) >= 0) {
			return false
		}
	}
	return true
}

// ValidMetadataValue reports whether v is printable US-ASCII.
func ValidMetadataValue(v string) bool {
	for i := 0; i < len(v); i++ {
		if v[i] < 0x20 || v[i] > 0x7e {
			return false
		}
	}
	return len(v) <= 64*1024
}

// WriteMetadata makes md the metadata of an open file: keys it does not name are removed (a file
// written again without metadata has none, as in E2B; an O_TRUNC open keeps xattrs).
func WriteMetadata(f *os.File, md map[string]string) error {
	fd := int(f.Fd())
	if names, err := listXattrs(func(b []byte) (int, error) { return unix.Flistxattr(fd, b) }); err == nil {
		for _, n := range names {
			if k, ok := strings.CutPrefix(n, xattrPrefix); ok {
				if _, keep := md[k]; !keep {
					if err := unix.Fremovexattr(fd, n); err != nil && !errors.Is(err, unix.ENODATA) {
						return fmt.Errorf("clear metadata %q: %w", k, err)
					}
				}
			}
		}
	}
	for k, v := range md {
		if err := unix.Fsetxattr(int(f.Fd()), xattrPrefix+k, []byte(v), 0); err != nil {
			if errors.Is(err, unix.ENOTSUP) || errors.Is(err, unix.EOPNOTSUPP) {
				return ErrMetadataUnsupported
			}
			return fmt.Errorf("set metadata %q: %w", k, err)
		}
	}
	return nil
}

// listXattrs lists attribute names through list (a listxattr variant): none when there are none.
func listXattrs(list func([]byte) (int, error)) ([]string, error) {
	sz, err := list(nil)
	if err != nil || sz <= 0 {
		return nil, err
	}
	buf := make([]byte, sz)
	if sz, err = list(buf); err != nil {
		return nil, err
	}
	var names []string
	for _, name := range bytes.Split(buf[:sz], []byte{0}) {
		if len(name) > 0 {
			names = append(names, string(name))
		}
	}
	return names, nil
}

// ReadMetadata returns the metadata of path (not following symlinks); nil when there is none.
func ReadMetadata(path string) map[string]string {
	names, err := listXattrs(func(b []byte) (int, error) { return unix.Llistxattr(path, b) })
	if err != nil {
		return nil
	}
	var md map[string]string
	for _, n := range names {
		if !strings.HasPrefix(n, xattrPrefix) {
			continue
		}
		vs, err := unix.Lgetxattr(path, n, nil)
		if err != nil {
			continue
		}
		val := make([]byte, vs)
		vs, err = unix.Lgetxattr(path, n, val)
		if err != nil {
			continue
		}
		if md == nil {
			md = map[string]string{}
		}
		md[n[len(xattrPrefix):]] = string(val[:vs])
	}
	return md
}
