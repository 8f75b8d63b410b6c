// Package base builds the node's built-in templates. "base" (BuildDebian) is Debian with
// what E2B's base offers (python3, node, git, curl, sudo...), made with debootstrap from
// Debian's packages. "base-minimal" (Build) is a small root filesystem directory made from
// Debian's statically linked busybox and bash, built in a second from the host's binaries,
// for the fastest sandboxes and for tests. Both have a root and an unprivileged "user"
// account, so E2B SDK calls (`/bin/bash -l -c CMD` as user) work without any image pull.
package base

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
)

// Version is the stamp of the minimal (busybox) base; bump it when the layout changes so
// an existing build is replaced.
const Version = "aenv-base-1"

// StampFile marks a finished build inside the rootfs. Its content is Version.
const StampFile = ".aenv-base"

// EnvdMountpoint is the empty file inside the rootfs over which backends bind-mount the
// host's envd binary.
const EnvdMountpoint = "/.aenv/envd"

// UserUID and UserGID are the ids of the "user" account (E2B's default user).
const (
	UserUID = 1000
	UserGID = 1000
)

// ErrMissingTool means a host binary the build copies (busybox-static, bash-static) is absent.
var ErrMissingTool = errors.New("required static binary missing")

// Options configure Build.
type Options struct {
	// Out is the rootfs directory to create. Required.
	Out string
	// Busybox is the host's static busybox (Debian busybox-static). Default /bin/busybox.
	Busybox string
	// Bash is the host's static bash (Debian bash-static). Default /bin/bash-static.
	Bash string
	// Force rebuilds even if Out already holds a finished build of this Version.
	Force bool
}

func (o *Options) defaults() error {
	if o.Out == "" {
		return errors.New("base: Options.Out is required")
	}
	if o.Busybox == "" {
		o.Busybox = "/bin/busybox"
	}
	if o.Bash == "" {
		o.Bash = "/bin/bash-static"
	}
	for _, p := range []struct{ path, pkg string }{{o.Busybox, "busybox-static"}, {o.Bash, "bash-static"}} {
		fi, err := os.Stat(p.path)
		if err != nil {
			return fmt.Errorf("%w: %s (install Debian package %s): %w", ErrMissingTool, p.path, p.pkg, err)
		}
		if fi.IsDir() || fi.Mode()&0o111 == 0 {
			return fmt.Errorf("%w: %s is not an executable file (install Debian package %s)", ErrMissingTool, p.path, p.pkg)
		}
	}
	return nil
}

// Built reports whether dir holds a finished build of this Version.
func Built(dir string) bool {
	b, err := os.ReadFile(filepath.Join(dir, StampFile))
	return err == nil && strings.TrimSpace(string(b)) == Version
}

// Build creates the minimal (busybox) base rootfs at o.Out. It builds into a sibling
// temporary directory and renames it into place, so a crash never leaves a half-built template at Out; when Out
// already holds a finished build of this Version it does nothing (unless Force).
func Build(ctx context.Context, o Options) error {
	if err := o.defaults(); err != nil {
		return err
	}
	if !o.Force && Built(o.Out) {
		return nil
	}
	return buildInto(o.Out, func(tmp string) error { return populate(ctx, tmp, o) })
}

type dirSpec struct {
	path string
	mode os.FileMode
	uid  int
}

var dirs = []dirSpec{
	{"bin", 0o755, 0}, {"sbin", 0o755, 0}, {"usr/bin", 0o755, 0}, {"usr/sbin", 0o755, 0},
	{"usr/local/bin", 0o755, 0}, {"usr/local/sbin", 0o755, 0}, {"etc", 0o755, 0},
	{"proc", 0o555, 0}, {"sys", 0o555, 0}, {"dev", 0o755, 0}, {"run", 0o755, 0},
	{"tmp", 0o777 | os.ModeSticky, 0}, {"var/tmp", 0o777 | os.ModeSticky, 0}, {"var/log", 0o755, 0},
	{"root", 0o700, 0}, {"home", 0o755, 0}, {"home/user", 0o755, UserUID}, {".aenv", 0o755, 0},
	{"mnt", 0o755, 0}, {"opt", 0o755, 0}, {"lib", 0o755, 0}, {"usr/lib", 0o755, 0},
}

type fileSpec struct {
	path    string
	mode    os.FileMode
	content string
}

var files = []fileSpec{
	{"etc/passwd", 0o644, "root:x:0:0:root:/root:/bin/bash\n" +
		"nobody:x:65534:65534:nobody:/nonexistent:/bin/false\n" +
		fmt.Sprintf("user:x:%d:%d:user:/home/user:/bin/bash\n", UserUID, UserGID)},
	{"etc/group", 0o644, "root:x:0:\nsudo:x:27:user\nnogroup:x:65534:\n" +
		fmt.Sprintf("user:x:%d:\n", UserGID)},
	{"etc/shadow", 0o640, "root:*:19000:0:99999:7:::\nnobody:*:19000:0:99999:7:::\nuser:*:19000:0:99999:7:::\n"},
	{"etc/hosts", 0o644, "127.0.0.1\tlocalhost\n::1\tlocalhost ip6-localhost ip6-loopback\n"},
	// Placeholder: the backend may bind-mount a real resolver config over it.
	{"etc/resolv.conf", 0o644, "# written by aenv; replaced at sandbox start when DNS is configured\n"},
	{"etc/hostname", 0o644, "sandbox\n"},
	{"etc/shells", 0o644, "/bin/sh\n/bin/bash\n/bin/ash\n"},
	{"etc/os-release", 0o644, "NAME=\"aenv base\"\nID=aenv-base\nPRETTY_NAME=\"aenv base (busybox + bash)\"\n"},
	{"etc/profile", 0o644, "export PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin\n" +
		"[ -n \"$HOME\" ] || export HOME=$(cd ~ 2>/dev/null && pwd)\n" +
		"export LANG=C.UTF-8\n" +
		"for f in /etc/profile.d/*.sh; do [ -r \"$f\" ] && . \"$f\"; done; unset f\n"},
	{"etc/profile.d/.keep", 0o644, ""},
	{"root/.bashrc", 0o644, "PS1='\\u@\\h:\\w\\$ '\n"},
	{"home/user/.bashrc", 0o644, "PS1='\\u@\\h:\\w\\$ '\n"},
	{strings.TrimPrefix(EnvdMountpoint, "/"), 0o755, ""},
	{StampFile, 0o644, Version + "\n"},
}

func populate(ctx context.Context, root string, o Options) error {
	for _, d := range dirs {
		p := filepath.Join(root, d.path)
		if err := os.MkdirAll(p, 0o755); err != nil {
			return fmt.Errorf("base: mkdir %s: %w", d.path, err)
		}
		if err := os.Chmod(p, d.mode); err != nil {
			return fmt.Errorf("base: chmod %s: %w", d.path, err)
		}
		if d.uid != 0 {
			if err := os.Chown(p, d.uid, d.uid); err != nil {
				return fmt.Errorf("base: chown %s: %w", d.path, err)
			}
		}
	}
	if err := copyFile(o.Busybox, filepath.Join(root, "bin/busybox"), 0o755); err != nil {
		return err
	}
	if err := copyFile(o.Bash, filepath.Join(root, "bin/bash"), 0o755); err != nil {
		return err
	}
	applets, err := listApplets(ctx, o.Busybox)
	if err != nil {
		return err
	}
	for _, a := range applets {
		dst := filepath.Join(root, a)
		if _, err := os.Lstat(dst); err == nil {
			continue // bash and anything placed earlier win over busybox
		}
		if err := os.MkdirAll(filepath.Dir(dst), 0o755); err != nil {
			return fmt.Errorf("base: mkdir for applet %s: %w", a, err)
		}
		if err := os.Symlink("/bin/busybox", dst); err != nil {
			return fmt.Errorf("base: applet %s: %w", a, err)
		}
	}
	// sh is bash so `sh -c` scripts written for bash-isms still run; busybox ash stays as ash.
	shPath := filepath.Join(root, "bin/sh")
	_ = os.Remove(shPath)
	if err := os.Symlink("bash", shPath); err != nil {
		return fmt.Errorf("base: /bin/sh: %w", err)
	}
	for _, f := range files {
		p := filepath.Join(root, f.path)
		if err := os.MkdirAll(filepath.Dir(p), 0o755); err != nil {
			return fmt.Errorf("base: mkdir for %s: %w", f.path, err)
		}
		if err := os.WriteFile(p, []byte(f.content), f.mode); err != nil {
			return fmt.Errorf("base: write %s: %w", f.path, err)
		}
		if err := os.Chmod(p, f.mode); err != nil {
			return fmt.Errorf("base: chmod %s: %w", f.path, err)
		}
	}
	if err := os.Chown(filepath.Join(root, "home/user/.bashrc"), UserUID, UserGID); err != nil {
		return fmt.Errorf("base: chown .bashrc: %w", err)
	}
	return nil
}

// listApplets asks busybox for its applets as rootfs-relative paths ("usr/bin/wget").
func listApplets(ctx context.Context, busybox string) ([]string, error) {
	var out bytes.Buffer
	cmd := exec.CommandContext(ctx, busybox, "--list-full")
	cmd.Stdout = &out
	if err := cmd.Run(); err != nil {
		return nil, fmt.Errorf("base: %s --list-full: %w", busybox, err)
	}
	var applets []string
	for _, l := range strings.Split(out.String(), "\n") {
		l = strings.TrimSpace(l)
		if l == "" || strings.Contains(l, "..") || filepath.IsAbs(l) {
			continue
		}
		applets = append(applets, l)
	}
	if len(applets) == 0 {
		return nil, fmt.Errorf("base: %s lists no applets", busybox)
	}
	return applets, nil
}

func copyFile(src, dst string, mode os.FileMode) error {
	in, err := os.Open(src)
	if err != nil {
		return fmt.Errorf("base: open %s: %w", src, err)
	}
	defer in.Close()
	out, err := os.OpenFile(dst, os.O_CREATE|os.O_WRONLY|os.O_TRUNC, mode)
	if err != nil {
		return fmt.Errorf("base: create %s: %w", dst, err)
	}
	if _, err := io.Copy(out, in); err != nil {
		out.Close()
		return fmt.Errorf("base: copy %s: %w", src, err)
	}
	if err := out.Close(); err != nil {
		return fmt.Errorf("base: close %s: %w", dst, err)
	}
	return nil
}
