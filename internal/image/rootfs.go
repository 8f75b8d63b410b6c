package image

import (
	"bufio"
	"bytes"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path"
	"strconv"
	"strings"
)

// DefaultUser is the account the E2B SDKs and envd run commands as; its home
// is /home/<user>.
const DefaultUser = "user"

// EnvdMountpoint is the empty file backends bind-mount the host's envd over
// (the same path the base template provides).
const EnvdMountpoint = ".aenv/envd"

// firstUID is where a missing default user's uid search starts (1000, as
// E2B's images and most distributions' first user).
const firstUID = 1000

// prepareRootFS makes an unpacked image usable as a sandbox root: the
// directories every container runtime mounts over, the envd mount point, and
// the default user with its home. All edits go through os.Root, so links in
// the image cannot redirect them outside the rootfs. It returns the user's uid.
func prepareRootFS(rootfs, user string) (int, error) {
	r, err := os.OpenRoot(rootfs)
	if err != nil {
		return 0, err
	}
	defer r.Close()
	for _, d := range []struct {
		p    string
		mode fs.FileMode
	}{{"proc", 0o555}, {"sys", 0o555}, {"dev", 0o755}, {"etc", 0o755}, {"home", 0o755},
		{"tmp", 0o777 | fs.ModeSticky}, {"run", 0o755}, {".aenv", 0o755}} {
		if _, err := r.Lstat(d.p); errors.Is(err, fs.ErrNotExist) {
			if err := r.Mkdir(d.p, 0o755); err != nil {
				return 0, fmt.Errorf("rootfs: %w", err)
			}
			if err := r.Chmod(d.p, d.mode); err != nil {
				return 0, fmt.Errorf("rootfs: %w", err)
			}
		}
	}
	if _, err := r.Lstat(EnvdMountpoint); errors.Is(err, fs.ErrNotExist) {
		if err := r.WriteFile(EnvdMountpoint, nil, 0o755); err != nil {
			return 0, fmt.Errorf("rootfs: envd mount point: %w", err)
		}
	}
	for _, f := range []string{"etc/hosts", "etc/resolv.conf", "etc/hostname"} {
		if _, err := r.Lstat(f); errors.Is(err, fs.ErrNotExist) {
			if err := r.WriteFile(f, nil, 0o644); err != nil {
				return 0, fmt.Errorf("rootfs: %w", err)
			}
		}
	}
	return ensureUser(r, user)
}

// ensureUser adds user to /etc/passwd, /etc/group (and /etc/shadow when the
// image has one) unless it exists, and creates its home owned by it.
func ensureUser(r *os.Root, user string) (int, error) {
	passwd, err := readOptional(r, "etc/passwd")
	if err != nil {
		return 0, err
	}
	group, err := readOptional(r, "etc/group")
	if err != nil {
		return 0, err
	}
	home := "/home/" + user
	uid, gid, found := lookupUser(passwd, user)
	if found {
		if h := userHome(passwd, user); h != "" {
			home = h
		}
	} else {
		used := ids(passwd, 2)
		gids := ids(group, 2)
		uid = firstUID
		for used[uid] || gids[uid] {
			uid++
		}
		gid = uid
		if g, ok := lookupGroup(group, user); ok {
			gid = g
		}
		shell := "/bin/sh"
		if _, err := r.Stat("bin/bash"); err == nil {
			shell = "/bin/bash"
		}
		if err := appendLine(r, "etc/passwd", passwd, fmt.Sprintf("%s:x:%d:%d::%s:%s", user, uid, gid, home, shell)); err != nil {
			return 0, err
		}
		if _, ok := lookupGroup(group, user); !ok {
			if err := appendLine(r, "etc/group", group, fmt.Sprintf("%s:x:%d:", user, gid)); err != nil {
				return 0, err
			}
		}
		if shadow, err := r.ReadFile("etc/shadow"); err == nil && !hasEntry(shadow, user) {
			if err := appendLine(r, "etc/shadow", shadow, user+":*:19000:0:99999:7:::"); err != nil {
				return 0, err
			}
		}
	}
	h := strings.TrimPrefix(path.Clean(home), "/")
	if h == "" || h == "." {
		return uid, nil
	}
	if _, err := r.Lstat(h); errors.Is(err, fs.ErrNotExist) {
		if err := r.MkdirAll(h, 0o755); err != nil {
			return 0, fmt.Errorf("rootfs: home %s: %w", home, err)
		}
		if err := r.Chmod(h, 0o755); err != nil {
			return 0, err
		}
		if os.Geteuid() == 0 {
			if err := r.Lchown(h, uid, gid); err != nil {
				return 0, fmt.Errorf("rootfs: home %s: %w", home, err)
			}
		}
	}
	return uid, nil
}

func readOptional(r *os.Root, p string) ([]byte, error) {
	b, err := r.ReadFile(p)
	if errors.Is(err, fs.ErrNotExist) {
		return nil, nil
	}
	if err != nil {
		return nil, fmt.Errorf("rootfs: read /%s: %w", p, err)
	}
	return b, nil
}

func appendLine(r *os.Root, p string, old []byte, line string) error {
	var buf bytes.Buffer
	buf.Write(old)
	if len(old) > 0 && old[len(old)-1] != '\n' {
		buf.WriteByte('\n')
	}
	buf.WriteString(line + "\n")
	mode := fs.FileMode(0o644)
	if fi, err := r.Stat(p); err == nil {
		mode = fi.Mode().Perm()
	}
	// Replace rather than append in place: the file may be a hard link shared
	// with another path in the image.
	tmp := p + ".aenv-tmp"
	if err := r.WriteFile(tmp, buf.Bytes(), mode); err != nil {
		return fmt.Errorf("rootfs: write /%s: %w", p, err)
	}
	if err := r.Rename(tmp, p); err != nil {
		r.Remove(tmp)
		return fmt.Errorf("rootfs: write /%s: %w", p, err)
	}
	return nil
}

func fields(b []byte, fn func(f []string) bool) {
	sc := bufio.NewScanner(bytes.NewReader(b))
	for sc.Scan() {
		line := sc.Text()
		if strings.HasPrefix(line, "#") {
			continue
		}
		if !fn(strings.Split(line, ":")) {
			return
		}
	}
}

func lookupUser(passwd []byte, user string) (uid, gid int, ok bool) {
	fields(passwd, func(f []string) bool {
		if len(f) >= 4 && f[0] == user {
			u, e1 := strconv.Atoi(f[2])
			g, e2 := strconv.Atoi(f[3])
			if e1 == nil && e2 == nil {
				uid, gid, ok = u, g, true
				return false
			}
		}
		return true
	})
	return uid, gid, ok
}

func userHome(passwd []byte, user string) (home string) {
	fields(passwd, func(f []string) bool {
		if len(f) >= 6 && f[0] == user {
			home = f[5]
			return false
		}
		return true
	})
	return home
}

func lookupGroup(group []byte, name string) (gid int, ok bool) {
	fields(group, func(f []string) bool {
		if len(f) >= 3 && f[0] == name {
			if g, err := strconv.Atoi(f[2]); err == nil {
				gid, ok = g, true
				return false
			}
		}
		return true
	})
	return gid, ok
}

func hasEntry(b []byte, name string) (found bool) {
	fields(b, func(f []string) bool {
		found = f[0] == name
		return !found
	})
	return found
}

// ids collects the numeric field col of an /etc/passwd- or group-style file.
func ids(b []byte, col int) map[int]bool {
	out := map[int]bool{}
	fields(b, func(f []string) bool {
		if len(f) > col {
			if n, err := strconv.Atoi(f[col]); err == nil {
				out[n] = true
			}
		}
		return true
	})
	return out
}

// AccountName resolves an image's USER (a name or a uid, optionally with ":group") to the
// name of its account in rootfs's /etc/passwd, which is what sandboxes run processes as;
// false when the image has no such account (Docker would run as the bare uid, which
// envd cannot).
func AccountName(rootfs, user string) (string, bool, error) {
	u, _, _ := strings.Cut(user, ":")
	if u == "" {
		return "", false, nil
	}
	r, err := os.OpenRoot(rootfs)
	if err != nil {
		return "", false, err
	}
	defer r.Close()
	passwd, err := readOptional(r, "etc/passwd")
	if err != nil {
		return "", false, err
	}
	var name string
	fields(passwd, func(f []string) bool {
		if len(f) >= 3 && f[0] != "" && (f[0] == u || f[2] == u) {
			name = f[0]
			return false
		}
		return true
	})
	return name, name != "", nil
}
