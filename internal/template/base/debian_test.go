package base

import (
	"context"
	"errors"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"

	"github.com/aenv-dev/aenv/test/debian"
)

func needDebootstrap(t *testing.T) {
	t.Helper()
	if os.Geteuid() != 0 {
		t.Skip("needs root (debootstrap, chroot)")
	}
	if _, err := exec.LookPath("debootstrap"); err != nil {
		t.Skip("needs debootstrap (scripts/deps.sh installs it)")
	}
}

// configureDebian on a real minbase root (the tests' cached one, copied): the user account
// with passwordless sudo, aenv's files, the stamp, no package caches.
func TestConfigureDebian(t *testing.T) {
	needDebootstrap(t)
	repo, err := filepath.Abs("../../..")
	if err != nil {
		t.Fatal(err)
	}
	src, err := debian.Root(context.Background(), repo)
	if err != nil {
		t.Fatal(err)
	}
	root := filepath.Join(t.TempDir(), "root")
	if out, err := exec.Command("cp", "-a", src, root).CombinedOutput(); err != nil {
		t.Fatalf("cp: %v: %s", err, out)
	}
	if err := configureDebian(context.Background(), root); err != nil {
		t.Fatal(err)
	}
	if !DebianBuilt(root) || Built(root) {
		t.Fatal("stamp: want the Debian base's")
	}
	read := func(p string) string {
		b, err := os.ReadFile(filepath.Join(root, p))
		if err != nil {
			t.Fatal(err)
		}
		return string(b)
	}
	if !strings.Contains(read("etc/passwd"), "user:x:1000:1000::/home/user:/bin/bash\n") {
		t.Errorf("passwd:\n%s", read("etc/passwd"))
	}
	if !strings.Contains(read("etc/group"), "sudo:x:27:user\n") {
		t.Errorf("user is not in group sudo:\n%s", read("etc/group"))
	}
	for _, c := range []struct {
		path string
		mode os.FileMode
		uid  uint32
	}{{"etc/sudoers.d/aenv-user", 0o440, 0}, {"home/user", 0o755, UserUID}, {".aenv/envd", 0o755, 0},
		{"etc/profile.d/aenv.sh", 0o644, 0}} {
		fi, err := os.Lstat(filepath.Join(root, c.path))
		if err != nil {
			t.Errorf("%s: %v", c.path, err)
			continue
		}
		if fi.Mode().Perm() != c.mode&os.ModePerm || ownerOf(fi) != c.uid {
			t.Errorf("%s: mode %v uid %d, want %v uid %d", c.path, fi.Mode(), ownerOf(fi), c.mode, c.uid)
		}
	}
	if s := read("etc/sudoers.d/aenv-user"); s != "user ALL=(ALL:ALL) NOPASSWD: ALL\n" {
		t.Errorf("sudoers: %q", s)
	}
	if s := read("etc/resolv.conf"); !strings.HasPrefix(s, "# written by aenv") {
		t.Errorf("the host's resolver leaked into the base: %q", s)
	}
	for _, g := range []string{"var/lib/apt/lists/*_*", "var/cache/apt/archives/*.deb", "usr/share/man/*", "debootstrap"} {
		if m, _ := filepath.Glob(filepath.Join(root, g)); len(m) != 0 {
			t.Errorf("left behind: %v", m)
		}
	}
	if _, err := os.Stat(filepath.Join(root, "usr/share/doc/bash/copyright")); err != nil {
		t.Errorf("copyright files must stay: %v", err)
	}
	// A login shell as user gets the profile's locale.
	out, err := exec.Command("chroot", "--userspec=1000:1000", root, "env", "-i", "HOME=/home/user",
		"/bin/bash", "-l", "-c", "id -un; echo $LANG").CombinedOutput()
	if err != nil || string(out) != "user\nC.UTF-8\n" {
		t.Errorf("su user: %v: %q", err, out)
	}
	// The login shells' PATHs are Debian's, root's with the sbin directories, and come
	// without running id(1): the test takes it away.
	if err := os.Rename(filepath.Join(root, "usr/bin/id"), filepath.Join(root, "usr/bin/id.gone")); err != nil {
		t.Fatal(err)
	}
	for _, c := range []struct{ spec, home, path string }{
		{"0:0", "/root", "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"},
		{"1000:1000", "/home/user", "/usr/local/bin:/usr/bin:/bin:/usr/local/games:/usr/games"},
	} {
		out, err := exec.Command("chroot", "--userspec="+c.spec, root, "env", "-i", "HOME="+c.home,
			"/bin/bash", "-l", "-c", "echo $PATH").CombinedOutput()
		if err != nil || string(out) != c.path+"\n" {
			t.Errorf("login shell as %s: %v: %q, want PATH %s", c.spec, err, out, c.path)
		}
	}
}

// loginWithoutID rewrites Debian's check of the user's id and nothing else.
func TestLoginWithoutID(t *testing.T) {
	dir := t.TempDir()
	for _, c := range []struct{ name, in, want string }{
		{"debian", "if [ \"$(id -u)\" -eq 0 ]; then\n  PATH=a\nfi\n    if [ \"$(id -u)\" -eq 0 ]; then\n",
			"if [ \"${EUID:-$(id -u)}\" -eq 0 ]; then\n  PATH=a\nfi\n    if [ \"${EUID:-$(id -u)}\" -eq 0 ]; then\n"},
		{"no check", "export PATH=/bin\n", "export PATH=/bin\n"},
		{"other id use", "ID=$(id -un)\n", "ID=$(id -un)\n"},
	} {
		p := filepath.Join(dir, c.name)
		if err := os.WriteFile(p, []byte(c.in), 0o644); err != nil {
			t.Fatal(err)
		}
		if err := loginWithoutID(p); err != nil {
			t.Fatalf("%s: %v", c.name, err)
		}
		if b, _ := os.ReadFile(p); string(b) != c.want {
			t.Errorf("%s: %q, want %q", c.name, b, c.want)
		}
	}
	if err := loginWithoutID(filepath.Join(dir, "missing")); err == nil {
		t.Error("a missing profile: no error")
	}
}

// A mirror that cannot be reached: a clear error naming it, nothing left at Out or beside
// it, no mounts.
func TestBuildDebianUnreachableMirror(t *testing.T) {
	needDebootstrap(t)
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	mirror := "http://" + l.Addr().String() + "/debian"
	l.Close()
	dir := t.TempDir()
	out := filepath.Join(dir, "base")
	var lines []string
	err = BuildDebian(context.Background(), DebianOptions{Out: out, Mirror: mirror, CacheDir: filepath.Join(dir, "cache"),
		Progress: func(l string) { lines = append(lines, l) }})
	if err == nil || !strings.Contains(err.Error(), mirror) || !strings.Contains(err.Error(), "debootstrap") {
		t.Fatalf("err = %v", err)
	}
	if len(lines) == 0 {
		t.Error("no progress lines")
	}
	entries, _ := os.ReadDir(dir)
	for _, e := range entries {
		if e.Name() != "cache" {
			t.Errorf("left behind: %s", e.Name())
		}
	}
	if b, _ := os.ReadFile("/proc/self/mountinfo"); strings.Contains(string(b), dir) {
		t.Error("a mount under the build directory was left")
	}
}

func TestBuildDebianRefusals(t *testing.T) {
	if err := BuildDebian(context.Background(), DebianOptions{}); err == nil {
		t.Fatal("no Out: want an error")
	}
	if os.Geteuid() != 0 {
		err := BuildDebian(context.Background(), DebianOptions{Out: filepath.Join(t.TempDir(), "b")})
		if !errors.Is(err, ErrDebianUnavailable) {
			t.Fatalf("err = %v", err)
		}
	}
	// A finished build of this version is left alone, without debootstrap.
	out := t.TempDir()
	os.WriteFile(filepath.Join(out, StampFile), []byte(DebianVersion+"\n"), 0o644)
	os.WriteFile(filepath.Join(out, "marker"), nil, 0o644)
	if err := BuildDebian(context.Background(), DebianOptions{Out: out, Mirror: "http://127.0.0.1:1/none"}); err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(filepath.Join(out, "marker")); err != nil {
		t.Fatal("a finished build was replaced")
	}
}

func TestHostMirror(t *testing.T) {
	if m := HostMirror(); !strings.HasPrefix(m, "http") || strings.HasSuffix(m, "/") {
		t.Fatalf("HostMirror() = %q", m)
	}
}

func ownerOf(fi os.FileInfo) uint32 { return fi.Sys().(*syscall.Stat_t).Uid }
