package filesystem

import (
	"bytes"
	"errors"
	"fmt"
	"os"
	"strings"

	"golang.org/x/sys/unix"
)

// File metadata (envd >= 0.6.2) is stored as user extended attributes: metadata key k is the
// xattr "user.k". Keys are HTTP header tokens (lower-cased, since header names are not
// case-preserving); values are printable ASCII.
const xattrPrefix = "user."

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

// WriteMetadata sets the metadata on an open file.
func WriteMetadata(f *os.File, md map[string]string) error {
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

// ReadMetadata returns the metadata of path (not following symlinks); nil when there is none.
func ReadMetadata(path string) map[string]string {
	sz, err := unix.Llistxattr(path, nil)
	if err != nil || sz <= 0 {
		return nil
	}
	buf := make([]byte, sz)
	sz, err = unix.Llistxattr(path, buf)
	if err != nil {
		return nil
	}
	var md map[string]string
	for _, name := range bytes.Split(buf[:sz], []byte{0}) {
		n := string(name)
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
