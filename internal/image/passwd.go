package image

import (
	"bytes"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"strconv"
	"strings"
	"syscall"
)

// Limits on the account files an image may carry. envd reads them with a 1 MiB line
// buffer; refusing far smaller lines at pull time keeps a hostile image from failing
// every create later.
const (
	maxAccountsFile = 4 << 20
	maxAccountsLine = 64 << 10
)

// accounts is an /etc/passwd- or /etc/group-style file.
type accounts struct {
	path  string // root-relative, symlinks resolved
	data  []byte
	exist bool
}

// readAccounts reads the account file at rel (resolved, no symlinks); a missing file is
// empty. Files too big or with lines too long for envd are refused.
func readAccounts(r *os.Root, rel string) (accounts, error) {
	a := accounts{path: rel}
	fi, err := r.Lstat(rel)
	if errors.Is(err, fs.ErrNotExist) {
		return a, nil
	}
	if err != nil {
		return a, fmt.Errorf("rootfs: /%s: %w", rel, err)
	}
	if !fi.Mode().IsRegular() {
		return a, fmt.Errorf("%w: /%s is not a regular file", ErrUnusableImage, rel)
	}
	if fi.Size() > maxAccountsFile {
		return a, fmt.Errorf("%w: /%s is %d bytes (at most %d)", ErrUnusableImage, rel, fi.Size(), maxAccountsFile)
	}
	if a.data, err = r.ReadFile(rel); err != nil {
		return a, fmt.Errorf("rootfs: read /%s: %w", rel, err)
	}
	a.exist = true
	for n, line := range bytes.Split(a.data, []byte{'\n'}) {
		if len(line) > maxAccountsLine {
			return a, fmt.Errorf("%w: /%s line %d is %d bytes long (at most %d)", ErrUnusableImage, rel, n+1, len(line), maxAccountsLine)
		}
	}
	return a, nil
}

// each calls fn with the colon-separated fields of every line that is not empty or a
// comment, until fn returns false. It skips what envd's reader skips.
func (a accounts) each(fn func(f []string) bool) {
	for _, line := range bytes.Split(a.data, []byte{'\n'}) {
		if len(line) == 0 || line[0] == '#' {
			continue
		}
		if !fn(strings.Split(string(line), ":")) {
			return
		}
	}
}

// account is a usable passwd entry: what envd's identity.Lookup accepts (seven fields,
// numeric 32-bit uid and gid). Lines that are not usable are ignored, as envd ignores them.
type account struct {
	name     string
	uid, gid int
	home     string
}

func usableAccount(f []string) (account, bool) {
	if len(f) < 7 || f[0] == "" {
		return account{}, false
	}
	uid, e1 := strconv.ParseUint(f[2], 10, 32)
	gid, e2 := strconv.ParseUint(f[3], 10, 32)
	if e1 != nil || e2 != nil {
		return account{}, false
	}
	return account{name: f[0], uid: int(uid), gid: int(gid), home: f[5]}, true
}

// lookup finds the first usable entry whose name is name, or whose uid is name when
// byUID is set.
func (a accounts) lookup(name string, byUID bool) (acct account, ok bool) {
	a.each(func(f []string) bool {
		u, usable := usableAccount(f)
		if usable && (u.name == name || byUID && f[2] == name) {
			acct, ok = u, true
		}
		return !ok
	})
	return acct, ok
}

// groupID is the gid of the group named name.
func (a accounts) groupID(name string) (gid int, ok bool) {
	a.each(func(f []string) bool {
		if len(f) >= 3 && f[0] == name {
			if g, err := strconv.ParseUint(f[2], 10, 32); err == nil {
				gid, ok = int(g), true
			}
		}
		return !ok
	})
	return gid, ok
}

func (a accounts) has(name string) (found bool) {
	a.each(func(f []string) bool {
		found = f[0] == name
		return !found
	})
	return found
}

// ids collects the numeric field col of every line.
func (a accounts) ids(col int) map[int]bool {
	out := map[int]bool{}
	a.each(func(f []string) bool {
		if len(f) > col {
			if n, err := strconv.ParseUint(f[col], 10, 32); err == nil {
				out[int(n)] = true
			}
		}
		return true
	})
	return out
}

// add appends line to the file, replacing it rather than writing in place (it may be a
// hard link shared with another path of the image) and keeping its mode and owner.
func (a *accounts) add(r *os.Root, line string) error {
	var buf bytes.Buffer
	buf.Write(a.data)
	if len(a.data) > 0 && a.data[len(a.data)-1] != '\n' {
		buf.WriteByte('\n')
	}
	buf.WriteString(line + "\n")
	mode, uid, gid := fs.FileMode(0o644), -1, -1
	if fi, err := r.Lstat(a.path); err == nil {
		mode = fi.Mode().Perm()
		uid, gid = ownerOf(fi)
	}
	tmp := a.path + ".aenv-tmp"
	if err := r.WriteFile(tmp, buf.Bytes(), mode); err != nil {
		return fmt.Errorf("rootfs: write /%s: %w", a.path, err)
	}
	if uid >= 0 && os.Geteuid() == 0 {
		if err := r.Lchown(tmp, uid, gid); err != nil {
			r.Remove(tmp)
			return fmt.Errorf("rootfs: write /%s: %w", a.path, err)
		}
	}
	if err := r.Chmod(tmp, mode); err != nil {
		r.Remove(tmp)
		return fmt.Errorf("rootfs: write /%s: %w", a.path, err)
	}
	if err := r.Rename(tmp, a.path); err != nil {
		r.Remove(tmp)
		return fmt.Errorf("rootfs: write /%s: %w", a.path, err)
	}
	a.data, a.exist = buf.Bytes(), true
	return nil
}

func ownerOf(fi fs.FileInfo) (uid, gid int) {
	if st, ok := fi.Sys().(*syscall.Stat_t); ok {
		return int(st.Uid), int(st.Gid)
	}
	return -1, -1
}
