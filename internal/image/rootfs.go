package image

import (
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path"
	"slices"
	"strings"

	"github.com/aenv-dev/aenv/internal/image/unpack"
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

// ErrUnusableImage marks an image that cannot be a sandbox root (no /etc/passwd, no
// /bin/sh, no place for the default user's home, account files envd cannot read): the
// template is refused when it is pulled or built, never at create.
var ErrUnusableImage = errors.New("the image cannot run sandboxes")

// PrepareVersion names what PrepareRootFS does; converted images key their last layer
// (the one PrepareRootFS writes) on it, so bump it when PrepareRootFS's output changes.
const PrepareVersion = "aenv-prepare-1"

// runtimeMounts are the directories every sandbox runtime mounts over; nothing the
// image keeps there is visible in a sandbox.
var runtimeMounts = []string{"proc", "sys", "dev"}

// PrepareRootFS makes an image's root (an unpacked directory, or a converted image's
// mounted filesystem) usable as a sandbox root: the directories every container runtime
// mounts over, the envd mount point, and the account user (uid 1000 when free, else the
// next free one; home /home/<user> owned by it; login shell bash when the image has one,
// else sh) unless the image has it. Every edit goes through os.Root with chroot
// semantics for links, so links in the image cannot redirect them outside root. It
// returns the user's uid; an image that cannot run sandboxes is ErrUnusableImage.
func PrepareRootFS(root, user string) (int, error) {
	r, err := os.OpenRoot(root)
	if err != nil {
		return 0, err
	}
	defer r.Close()
	if !executable(r, "bin/sh") {
		return 0, fmt.Errorf("%w: it has no /bin/sh, which envd runs commands with", ErrUnusableImage)
	}
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

// executable reports whether p (root-relative) resolves inside r to an executable file.
func executable(r *os.Root, p string) bool {
	rel, err := unpack.Resolve(r, p)
	if err != nil {
		return false
	}
	fi, err := r.Lstat(rel)
	return err == nil && fi.Mode().IsRegular() && fi.Mode().Perm()&0o111 != 0
}

// accountsFile reads /etc/<name> with links resolved as in the sandbox.
func accountsFile(r *os.Root, name string) (accounts, error) {
	rel, err := unpack.Resolve(r, "etc/"+name)
	if err != nil {
		return accounts{}, fmt.Errorf("%w: /etc/%s: %v", ErrUnusableImage, name, err)
	}
	return readAccounts(r, rel)
}

// ensureUser adds user to /etc/passwd, /etc/group (and /etc/shadow when the image has
// one) unless it has a usable entry, and makes its home.
func ensureUser(r *os.Root, user string) (int, error) {
	passwd, err := accountsFile(r, "passwd")
	if err != nil {
		return 0, err
	}
	if !passwd.exist {
		return 0, fmt.Errorf("%w: it has no /etc/passwd, so no user (not even root) can run commands", ErrUnusableImage)
	}
	group, err := accountsFile(r, "group")
	if err != nil {
		return 0, err
	}
	if acct, ok := passwd.lookup(user, false); ok {
		if !path.IsAbs(acct.home) {
			return acct.uid, nil // the image's own account; envd uses its home as it is
		}
		return acct.uid, makeHome(r, acct.home, acct.uid, acct.gid, false)
	}
	used, gids := passwd.ids(2), group.ids(2)
	uid := firstUID
	for used[uid] || gids[uid] {
		uid++
	}
	gid, hasGroup := group.groupID(user)
	if !hasGroup {
		gid = uid
	}
	shell := "/bin/sh"
	if executable(r, "bin/bash") {
		shell = "/bin/bash"
	}
	home := "/home/" + user
	if err := passwd.add(r, fmt.Sprintf("%s:x:%d:%d::%s:%s", user, uid, gid, home, shell)); err != nil {
		return 0, err
	}
	if !hasGroup {
		if err := group.add(r, fmt.Sprintf("%s:x:%d:", user, gid)); err != nil {
			return 0, err
		}
	}
	shadow, err := accountsFile(r, "shadow")
	if err != nil {
		return 0, err
	}
	if shadow.exist && !shadow.has(user) {
		if err := shadow.add(r, user+":*:19000:0:99999:7:::"); err != nil {
			return 0, err
		}
	}
	return uid, makeHome(r, home, uid, gid, true)
}

// makeHome makes the directory home (absolute, resolved as in the sandbox) when it is
// missing, owned by uid:gid; own also gives an existing one to uid:gid (a new account's
// home the image already had).
func makeHome(r *os.Root, home string, uid, gid int, own bool) error {
	h, err := unpack.Resolve(r, home)
	if err != nil {
		return fmt.Errorf("%w: home %s: %v", ErrUnusableImage, home, err)
	}
	top, _, _ := strings.Cut(h, "/")
	if h == "" || slices.Contains(runtimeMounts, top) {
		return fmt.Errorf("%w: home %s resolves to /%s, which is not the image's to keep", ErrUnusableImage, home, h)
	}
	fi, err := r.Lstat(h)
	switch {
	case errors.Is(err, fs.ErrNotExist):
		if err := r.MkdirAll(h, 0o755); err != nil {
			return fmt.Errorf("%w: home %s cannot be made (is /home read-only or not a directory?): %v", ErrUnusableImage, home, err)
		}
		if err := r.Chmod(h, 0o755); err != nil {
			return fmt.Errorf("rootfs: home %s: %w", home, err)
		}
		own = true
	case err != nil:
		return fmt.Errorf("rootfs: home %s: %w", home, err)
	case !fi.IsDir():
		return fmt.Errorf("%w: home %s is not a directory", ErrUnusableImage, home)
	}
	if own && os.Geteuid() == 0 {
		if err := r.Lchown(h, uid, gid); err != nil {
			return fmt.Errorf("rootfs: home %s: %w", home, err)
		}
	}
	return nil
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
	passwd, err := accountsFile(r, "passwd")
	if err != nil {
		return "", false, err
	}
	acct, ok := passwd.lookup(u, true)
	return acct.name, ok, nil
}
