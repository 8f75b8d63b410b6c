package base

import (
	"bufio"
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"sort"
	"strings"
	"sync"

	"golang.org/x/sys/unix"
)

// DebianVersion is the stamp of the Debian base; bump it when the package list or the
// configuration below changes, so nodes and `make base` rebuild.
const DebianVersion = "aenv-base-debian-2"

// DebianPackages are what the Debian base adds to debootstrap's minbase (coreutils, bash,
// grep, sed, tar, gzip, findutils, apt, ...): what E2B's base offers SDK code (its Git
// helper, curl, python3, node, sudo, tput through ncurses).
var DebianPackages = []string{
	"ca-certificates", "curl", "git", "less", "ncurses-base", "ncurses-bin", "netbase",
	"nodejs", "procps", "python-is-python3", "python3", "sudo",
}

// DebianEnv is the environment of the base template's processes: without a terminal,
// TERM would be unset (bash makes it "dumb") and tput, as SDK code calls it, would fail.
var DebianEnv = map[string]string{"TERM": "xterm-256color"}

// DefaultSuite is the Debian release the base is made from.
const DefaultSuite = "bookworm"

// ErrDebianUnavailable means this host cannot run debootstrap (not root, no debootstrap).
var ErrDebianUnavailable = errors.New("the Debian base cannot be built on this host")

// DebianOptions configure BuildDebian.
type DebianOptions struct {
	// Out is the rootfs directory to create. Required.
	Out string
	// Suite is the Debian release (DefaultSuite).
	Suite string
	// Mirror is the Debian archive; empty: the one the host's apt uses, else
	// http://deb.debian.org/debian.
	Mirror string
	// CacheDir keeps the downloaded packages (debootstrap --cache-dir), so a rebuild (a
	// new DebianVersion, another node's data dir) does not download them again.
	CacheDir string
	// Progress receives debootstrap's progress lines ("I: Retrieving git ...").
	Progress func(line string)
	// Force rebuilds even if Out already holds a finished build of DebianVersion.
	Force bool
}

// DebianBuilt reports whether dir holds a finished Debian base of DebianVersion.
func DebianBuilt(dir string) bool {
	b, err := os.ReadFile(filepath.Join(dir, StampFile))
	return err == nil && strings.TrimSpace(string(b)) == DebianVersion
}

// BuildDebian makes the Debian base at o.Out: debootstrap --variant=minbase with
// DebianPackages, then the `user` account (uid 1000, passwordless sudo, as on E2B) and
// what aenv's backends expect. Like Build it builds beside Out and renames, so a failed
// or cancelled build leaves nothing (no files, no mounts), and it does nothing when Out
// already holds this version. It needs root, debootstrap and the mirror (about 150 MB of
// packages, fewer when CacheDir holds them).
func BuildDebian(ctx context.Context, o DebianOptions) error {
	if o.Out == "" {
		return errors.New("base: DebianOptions.Out is required")
	}
	if !o.Force && DebianBuilt(o.Out) {
		return nil
	}
	if os.Geteuid() != 0 {
		return fmt.Errorf("%w: debootstrap needs root", ErrDebianUnavailable)
	}
	if _, err := exec.LookPath("debootstrap"); err != nil {
		return fmt.Errorf("%w: debootstrap is not installed (apt-get install debootstrap; scripts/deps.sh does)", ErrDebianUnavailable)
	}
	if o.Suite == "" {
		o.Suite = DefaultSuite
	}
	if o.Mirror == "" {
		o.Mirror = HostMirror()
	}
	if o.Progress == nil {
		o.Progress = func(string) {}
	}
	return buildInto(o.Out, func(tmp string) error {
		if err := debootstrap(ctx, tmp, o); err != nil {
			return err
		}
		return configureDebian(ctx, tmp)
	})
}

// buildInto runs fill on a fresh sibling of out and renames it to out; a failure removes
// it (unmounting whatever a killed chroot tool left mounted inside).
func buildInto(out string, fill func(tmp string) error) error {
	parent := filepath.Dir(out)
	if err := os.MkdirAll(parent, 0o755); err != nil {
		return fmt.Errorf("base: create parent: %w", err)
	}
	tmp, err := os.MkdirTemp(parent, "."+filepath.Base(out)+".build-")
	if err != nil {
		return fmt.Errorf("base: temp dir: %w", err)
	}
	ok := false
	defer func() {
		if !ok {
			unmountUnder(tmp)
			_ = os.RemoveAll(tmp)
		}
	}()
	if err := os.Chmod(tmp, 0o755); err != nil {
		return fmt.Errorf("base: chmod: %w", err)
	}
	if err := fill(tmp); err != nil {
		return err
	}
	if err := install(tmp, out); err != nil {
		return err
	}
	ok = true
	return nil
}

// install replaces out with the finished tree tmp: an older build is moved aside first so
// the rename of the new one is atomic, then deleted. Sandboxes already running on the old
// lower keep their inodes.
func install(tmp, out string) error {
	var old string
	if _, err := os.Lstat(out); err == nil {
		old = tmp + ".old"
		if err := os.Rename(out, old); err != nil {
			return fmt.Errorf("base: move old build aside: %w", err)
		}
	}
	if err := os.Rename(tmp, out); err != nil {
		if old != "" {
			_ = os.Rename(old, out)
		}
		return fmt.Errorf("base: install build: %w", err)
	}
	if old != "" {
		_ = os.RemoveAll(old)
	}
	return nil
}

func debootstrap(ctx context.Context, target string, o DebianOptions) error {
	args := []string{"--variant=minbase", "--include=" + strings.Join(DebianPackages, ",")}
	if o.CacheDir != "" {
		if err := os.MkdirAll(o.CacheDir, 0o755); err != nil {
			return fmt.Errorf("base: package cache: %w", err)
		}
		args = append(args, "--cache-dir="+o.CacheDir)
	}
	args = append(args, o.Suite, target, o.Mirror)
	cmd := exec.CommandContext(ctx, "debootstrap", args...)
	pr, pw := io.Pipe()
	cmd.Stdout, cmd.Stderr = pw, pw
	tail := newTail(30)
	var wg sync.WaitGroup
	wg.Add(1)
	go func() {
		defer wg.Done()
		sc := bufio.NewScanner(pr)
		for sc.Scan() {
			tail.add(sc.Text())
			o.Progress(sc.Text())
		}
		_, _ = io.Copy(io.Discard, pr)
	}()
	err := cmd.Run()
	pw.Close()
	wg.Wait()
	if ctx.Err() != nil {
		return fmt.Errorf("base: debootstrap: %w", ctx.Err())
	}
	if err != nil {
		// debootstrap keeps its own log in the target; its last lines name the failure.
		if b, rerr := os.ReadFile(filepath.Join(target, "debootstrap", "debootstrap.log")); rerr == nil {
			for _, l := range strings.Split(strings.TrimSpace(string(b)), "\n") {
				tail.add(l)
			}
		}
		return fmt.Errorf("base: debootstrap %s from %s failed (is the mirror reachable from this host?): %w\n%s",
			o.Suite, o.Mirror, err, strings.Join(tail.lines(), "\n"))
	}
	return nil
}

// debianFiles are written over what debootstrap made.
var debianFiles = []fileSpec{
	// E2B's base lets its `user` account use sudo without a password.
	{"etc/sudoers.d/aenv-user", 0o440, "user ALL=(ALL:ALL) NOPASSWD: ALL\n"},
	{"etc/profile.d/aenv.sh", 0o644, "export LANG=${LANG:-C.UTF-8}\n"},
	{"etc/hosts", 0o644, "127.0.0.1\tlocalhost sandbox\n::1\tlocalhost ip6-localhost ip6-loopback\n"},
	// debootstrap copies the host's resolver; the backend bind-mounts the sandbox's.
	{"etc/resolv.conf", 0o644, "# written by aenv; replaced at sandbox start when DNS is configured\n"},
	{"etc/hostname", 0o644, "sandbox\n"},
	{strings.TrimPrefix(EnvdMountpoint, "/"), 0o755, ""},
	// As Debian's -slim images: no manuals, docs or translations (70 MB of 420), also for
	// what users install later with apt.
	{"etc/dpkg/dpkg.cfg.d/aenv-slim", 0o644, "path-exclude /usr/share/doc/*\npath-include /usr/share/doc/*/copyright\n" +
		"path-exclude /usr/share/man/*\npath-exclude /usr/share/info/*\npath-exclude /usr/share/locale/*\n" +
		"path-include /usr/share/locale/locale.alias\n"},
}

// slimGlobs are removed after the install, as the dpkg excludes above would have.
var slimGlobs = []string{"usr/share/man/*", "usr/share/info/*", "usr/share/locale/*"}

func configureDebian(ctx context.Context, root string) error {
	// useradd inside the root: /etc/passwd, group, shadow, home from /etc/skel, as Debian does it.
	useradd := exec.CommandContext(ctx, "chroot", root, "useradd", "--create-home", "--user-group",
		"--uid", fmt.Sprint(UserUID), "--groups", "sudo", "--shell", "/bin/bash", "user")
	if out, err := useradd.CombinedOutput(); err != nil {
		return fmt.Errorf("base: useradd user: %w: %s", err, out)
	}
	if err := os.MkdirAll(filepath.Join(root, ".aenv"), 0o755); err != nil {
		return fmt.Errorf("base: %w", err)
	}
	for _, f := range debianFiles {
		p := filepath.Join(root, f.path)
		_ = os.Remove(p) // resolv.conf may be a symlink to the host's resolver
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
	if err := loginWithoutID(filepath.Join(root, "etc/profile")); err != nil {
		return err
	}
	if err := slimDocs(root); err != nil {
		return err
	}
	// What debootstrap leaves that no sandbox needs: package lists and archives, its log.
	for _, g := range append([]string{"var/cache/apt/archives/*.deb", "var/cache/apt/*.bin", "var/lib/apt/lists/*_*", "debootstrap"}, slimGlobs...) {
		matches, _ := filepath.Glob(filepath.Join(root, g))
		for _, m := range matches {
			if filepath.Base(m) == "locale.alias" {
				continue
			}
			if err := os.RemoveAll(m); err != nil {
				return fmt.Errorf("base: clean %s: %w", m, err)
			}
		}
	}
	return os.WriteFile(filepath.Join(root, StampFile), []byte(DebianVersion+"\n"), 0o644)
}

// idCheck is how Debian's /etc/profile asks whether the login is root's.
const idCheck = `"$(id -u)"`

// loginWithoutID has the profile at path ask the shell for the user's id ($EUID, which bash
// and zsh set) before running id(1), which it still does in shells without it. The E2B
// SDKs run every command in a login shell (bash -l): forking a subshell to run id took
// about half of a first command's CPU in the base (10.8 → 5.9 ms for `bash -l -c true`
// as user, perf stat on a 2-vCPU host). A profile without the check is left as it is.
func loginWithoutID(path string) error {
	b, err := os.ReadFile(path)
	if err != nil {
		return fmt.Errorf("base: %w", err)
	}
	out := bytes.ReplaceAll(b, []byte(idCheck), []byte(`"${EUID:-$(id -u)}"`))
	if bytes.Equal(out, b) {
		return nil
	}
	if err := os.WriteFile(path, out, 0o644); err != nil {
		return fmt.Errorf("base: %w", err)
	}
	return nil
}

// slimDocs removes /usr/share/doc except the copyright files.
func slimDocs(root string) error {
	pkgs, _ := filepath.Glob(filepath.Join(root, "usr/share/doc/*"))
	for _, p := range pkgs {
		entries, err := os.ReadDir(p)
		if err != nil {
			continue // a symlink to another package's docs, or a file
		}
		for _, e := range entries {
			if e.Name() == "copyright" {
				continue
			}
			if err := os.RemoveAll(filepath.Join(p, e.Name())); err != nil {
				return fmt.Errorf("base: slim %s: %w", p, err)
			}
		}
	}
	return nil
}

// HostMirror is the Debian archive the host's apt uses (deb822 or one-line sources),
// else Debian's CDN.
func HostMirror() string {
	files, _ := filepath.Glob("/etc/apt/sources.list.d/*.sources")
	for _, f := range files {
		b, _ := os.ReadFile(f)
		for _, l := range strings.Split(string(b), "\n") {
			if v, ok := strings.CutPrefix(strings.TrimSpace(l), "URIs:"); ok {
				for _, u := range strings.Fields(v) {
					if strings.HasSuffix(strings.TrimSuffix(u, "/"), "/debian") {
						return strings.TrimSuffix(u, "/")
					}
				}
			}
		}
	}
	lists, _ := filepath.Glob("/etc/apt/sources.list.d/*.list")
	for _, f := range append([]string{"/etc/apt/sources.list"}, lists...) {
		b, _ := os.ReadFile(f)
		for _, l := range strings.Split(string(b), "\n") {
			fs := strings.Fields(l)
			if len(fs) >= 2 && fs[0] == "deb" && !strings.HasPrefix(fs[1], "[") &&
				strings.HasSuffix(strings.TrimSuffix(fs[1], "/"), "/debian") {
				return strings.TrimSuffix(fs[1], "/")
			}
		}
	}
	return "http://deb.debian.org/debian"
}

// unmountUnder detaches every mount at or below dir (debootstrap mounts /proc and /sys
// in its target; a killed run leaves them).
func unmountUnder(dir string) {
	b, err := os.ReadFile("/proc/self/mountinfo")
	if err != nil {
		return
	}
	var mounts []string
	for _, l := range strings.Split(string(b), "\n") {
		fs := strings.Fields(l)
		if len(fs) > 4 && (fs[4] == dir || strings.HasPrefix(fs[4], dir+"/")) {
			mounts = append(mounts, fs[4])
		}
	}
	sort.Sort(sort.Reverse(sort.StringSlice(mounts))) // deepest first
	for _, m := range mounts {
		_ = unix.Unmount(m, unix.MNT_DETACH)
	}
}

// tail keeps the last n lines it was given.
type tail struct {
	mu sync.Mutex
	n  int
	l  []string
}

func newTail(n int) *tail { return &tail{n: n} }

func (t *tail) add(s string) {
	t.mu.Lock()
	defer t.mu.Unlock()
	t.l = append(t.l, s)
	if len(t.l) > t.n {
		t.l = t.l[len(t.l)-t.n:]
	}
}

func (t *tail) lines() []string {
	t.mu.Lock()
	defer t.mu.Unlock()
	return append([]string(nil), t.l...)
}
