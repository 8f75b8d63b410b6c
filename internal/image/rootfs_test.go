package image

import (
	"archive/tar"
	"context"
	"errors"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strings"
	"syscall"
	"testing"

	"github.com/google/go-containerregistry/pkg/v1/empty"
	"github.com/google/go-containerregistry/pkg/v1/mutate"
)

// TestEnsureUser: the account `user` is added when the image has no usable entry for it
// (uid 1000 when free, else the next; bash when the image has it, else sh; home owned by
// it), and an image's own entry is kept. Lines envd would skip (too few fields, a
// non-numeric id) do not count as the account.
func TestEnsureUser(t *testing.T) {
	const root0 = "root:x:0:0::/root:/bin/sh\n"
	cases := []struct {
		name          string
		passwd, group string
		files         map[string]string // extra files; "->x" makes a symlink to x, "/" a directory
		wantUID       int
		wantPasswd    string // a line that must be in /etc/passwd afterwards
		wantGroupLine string
		wantHome      string
	}{
		{name: "fresh", passwd: root0, group: "root:x:0:\n", wantUID: 1000,
			wantPasswd: "user:x:1000:1000::/home/user:/bin/sh", wantGroupLine: "user:x:1000:", wantHome: "home/user"},
		{name: "uid-1000-taken", passwd: root0 + "ubuntu:x:1000:1000::/home/ubuntu:/bin/bash\n",
			group: "root:x:0:\nubuntu:x:1000:\n", wantUID: 1001,
			wantPasswd: "user:x:1001:1001::/home/user:/bin/sh", wantGroupLine: "user:x:1001:", wantHome: "home/user"},
		{name: "gid-1000-taken", passwd: root0, group: "docker:x:1000:\n", wantUID: 1001,
			wantPasswd: "user:x:1001:1001::/home/user:/bin/sh", wantGroupLine: "user:x:1001:", wantHome: "home/user"},
		{name: "exists", passwd: root0 + "user:x:2000:2000::/work:/bin/sh", group: "user:x:2000:\n",
			wantUID: 2000, wantPasswd: "user:x:2000:2000::/work:/bin/sh", wantGroupLine: "user:x:2000:", wantHome: "work"},
		{name: "group-exists", passwd: root0, group: "user:x:500:\n", wantUID: 1000,
			wantPasswd: "user:x:1000:500::/home/user:/bin/sh", wantGroupLine: "user:x:500:", wantHome: "home/user"},
		{name: "bash through an absolute link (usr-merged)", passwd: root0,
			files:   map[string]string{"usr/bin/bash": "#!", "bin": "->/usr/bin", "usr/bin/sh": "->dash", "usr/bin/dash": "#!"},
			wantUID: 1000, wantPasswd: "user:x:1000:1000::/home/user:/bin/bash", wantGroupLine: "user:x:1000:", wantHome: "home/user"},
		{name: "home shipped without the account", passwd: root0, files: map[string]string{"home/user/": "/"},
			wantUID: 1000, wantPasswd: "user:x:1000:1000::/home/user:/bin/sh", wantGroupLine: "user:x:1000:", wantHome: "home/user"},
		{name: "home through an absolute link", passwd: root0, files: map[string]string{"home": "->/var/home", "var/home/": "/"},
			wantUID: 1000, wantPasswd: "user:x:1000:1000::/home/user:/bin/sh", wantGroupLine: "user:x:1000:", wantHome: "var/home/user"},
		{name: "hostile: six-field entry", passwd: root0 + "user:x:1000:1000::/home/user\n", wantUID: 1001,
			wantPasswd: "\nuser:x:1001:1001::/home/user:/bin/sh\n", wantGroupLine: "user:x:1001:", wantHome: "home/user"},
		{name: "hostile: non-numeric ids", passwd: root0 + "user:x:abc:-1::/:/bin/sh\nx:x:99999999999:0::/:/bin/sh\n",
			wantUID: 1000, wantPasswd: "\nuser:x:1000:1000::/home/user:/bin/sh\n", wantGroupLine: "user:x:1000:", wantHome: "home/user"},
		{name: "hostile: comments, blank lines, no final newline", passwd: "#user:x:0:0::/:/bin/sh\n\n\x00:x:1000:1000:::\nroot:x:0:0::/root:/bin/sh",
			wantUID: 1001, wantPasswd: "/bin/sh\nuser:x:1001:1001::/home/user:/bin/sh\n", wantGroupLine: "user:x:1001:", wantHome: "home/user"},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			root := t.TempDir()
			writeTree(t, root, c.files)
			if c.files["bin"] == "" {
				writeTree(t, root, map[string]string{"bin/sh": "#!"})
			}
			os.MkdirAll(filepath.Join(root, "etc"), 0o755)
			if c.passwd != "" {
				os.WriteFile(filepath.Join(root, "etc/passwd"), []byte(c.passwd), 0o644)
			}
			if c.group != "" {
				os.WriteFile(filepath.Join(root, "etc/group"), []byte(c.group), 0o644)
			}
			uid, err := PrepareRootFS(root, DefaultUser)
			if err != nil {
				t.Fatal(err)
			}
			if uid != c.wantUID {
				t.Errorf("uid = %d, want %d", uid, c.wantUID)
			}
			p, _ := os.ReadFile(filepath.Join(root, "etc/passwd"))
			g, _ := os.ReadFile(filepath.Join(root, "etc/group"))
			if !strings.Contains(string(p), c.wantPasswd) || !strings.Contains(string(g), c.wantGroupLine+"\n") {
				t.Errorf("passwd:\n%s\ngroup:\n%s", p, g)
			}
			if c.passwd != "" && !strings.HasPrefix(string(p), c.passwd) {
				t.Errorf("existing entries changed:\n%s", p)
			}
			fi, err := os.Lstat(filepath.Join(root, c.wantHome))
			if err != nil || !fi.IsDir() {
				t.Fatalf("home: %v", err)
			}
			if os.Geteuid() == 0 && int(fi.Sys().(*syscall.Stat_t).Uid) != uid {
				t.Errorf("home owned by %d", fi.Sys().(*syscall.Stat_t).Uid)
			}
			if _, err := os.Stat(filepath.Join(root, EnvdMountpoint)); err != nil {
				t.Errorf("envd mount point: %v", err)
			}
		})
	}
}

// TestPrepareRootFSRefuses: an image that cannot run sandboxes is refused with
// ErrUnusableImage and a message naming why, and no account is added.
func TestPrepareRootFSRefuses(t *testing.T) {
	const root0 = "root:x:0:0::/root:/bin/sh\n"
	for _, c := range []struct {
		name  string
		files map[string]string
		want  string
	}{
		{"no /etc/passwd", map[string]string{"bin/sh": "#!"}, "no /etc/passwd"},
		{"no /bin/sh", map[string]string{"etc/passwd": root0, "bin/bash": "#!"}, "no /bin/sh"},
		{"/bin/sh not executable", map[string]string{"etc/passwd": root0, "bin/sh": "-"}, "no /bin/sh"},
		{"/bin/sh a dangling link", map[string]string{"etc/passwd": root0, "bin/sh": "->/nowhere"}, "no /bin/sh"},
		{"/bin/sh a link loop", map[string]string{"etc/passwd": root0, "bin/sh": "->/bin/sh"}, "no /bin/sh"},
		{"/home a file", map[string]string{"etc/passwd": root0, "bin/sh": "#!", "home": "-"}, "home /home/user"},
		{"/home into /proc", map[string]string{"etc/passwd": root0, "bin/sh": "#!", "home": "->/proc/1"}, "home /home/user"},
		{"/home/user a file", map[string]string{"etc/passwd": root0, "bin/sh": "#!", "home/user": "-"}, "not a directory"},
		{"/etc/passwd a directory", map[string]string{"etc/passwd/": "/", "bin/sh": "#!"}, "not a regular file"},
		{"passwd line too long", map[string]string{"etc/passwd": root0 + "x:" + strings.Repeat("a", 70<<10) + "\n", "bin/sh": "#!"}, "line 2"},
		{"group line too long", map[string]string{"etc/passwd": root0, "etc/group": strings.Repeat("g", 70<<10), "bin/sh": "#!"}, "/etc/group line 1"},
	} {
		t.Run(c.name, func(t *testing.T) {
			root := t.TempDir()
			writeTree(t, root, c.files)
			before, _ := os.ReadFile(filepath.Join(root, "etc/passwd"))
			_, err := PrepareRootFS(root, DefaultUser)
			if !errors.Is(err, ErrUnusableImage) || !strings.Contains(err.Error(), c.want) {
				t.Fatalf("err = %v, want ErrUnusableImage naming %q", err, c.want)
			}
			if after, _ := os.ReadFile(filepath.Join(root, "etc/passwd")); c.name != "/home a file" && c.name != "/home into /proc" &&
				c.name != "/home/user a file" && string(after) != string(before) {
				t.Errorf("/etc/passwd changed by a refusal:\n%s", after)
			}
		})
	}
}

// TestAccountName: an image's USER resolves by name or uid to a usable entry only.
func TestAccountName(t *testing.T) {
	root := t.TempDir()
	writeTree(t, root, map[string]string{"etc/passwd": "root:x:0:0::/root:/bin/sh\nbad:x:1001:1001::/h\n" +
		"app:x:1002:1002::/srv:/bin/sh\n"})
	for _, c := range []struct {
		user, want string
		ok         bool
	}{{"app", "app", true}, {"1002", "app", true}, {"1002:1002", "app", true}, {"0", "root", true},
		{"12345", "", false}, {"bad", "", false}, {"1001", "", false}, {"", "", false}} {
		got, ok, err := AccountName(root, c.user)
		if err != nil || got != c.want || ok != c.ok {
			t.Errorf("AccountName(%q) = %q %v %v, want %q %v", c.user, got, ok, err, c.want, c.ok)
		}
	}
}

// writeTree makes files under root: "/" a directory, "->x" a symlink to x, "-" a plain
// file, anything else an executable file with that content.
func writeTree(t *testing.T, root string, files map[string]string) {
	t.Helper()
	for name, body := range files {
		p := filepath.Join(root, name)
		if err := os.MkdirAll(filepath.Dir(p), 0o755); err != nil {
			t.Fatal(err)
		}
		var err error
		switch {
		case body == "/":
			err = os.MkdirAll(p, 0o755)
		case strings.HasPrefix(body, "->"):
			err = os.Symlink(body[2:], p)
		case body == "-":
			err = os.WriteFile(p, nil, 0o644)
		case strings.HasPrefix(name, "etc/"):
			err = os.WriteFile(p, []byte(body), 0o644)
		default:
			err = os.WriteFile(p, []byte(body), 0o755)
		}
		if err != nil {
			t.Fatal(err)
		}
	}
}

// TestEnsureUserLinkOut: an image whose /etc/passwd links outside its root
// must not make the build write there.
func TestEnsureUserLinkOut(t *testing.T) {
	top := t.TempDir()
	outside := filepath.Join(top, "host-passwd")
	os.WriteFile(outside, []byte("root:x:0:0::/root:/bin/sh\n"), 0o644)
	root := filepath.Join(top, "root")
	os.MkdirAll(filepath.Join(root, "etc"), 0o755)
	os.Symlink(outside, filepath.Join(root, "etc/passwd"))
	_, err := PrepareRootFS(root, DefaultUser)
	if err == nil {
		t.Error("prepareRootFS followed /etc/passwd out of the root without error")
	}
	if b, _ := os.ReadFile(outside); string(b) != "root:x:0:0::/root:/bin/sh\n" {
		t.Errorf("file outside the root changed: %q", b)
	}
}

func TestBuildExt4(t *testing.T) {
	requireRoot(t)
	if _, err := exec.LookPath("mkfs.ext4"); err != nil {
		t.Skip("needs mkfs.ext4")
	}
	src := t.TempDir()
	os.MkdirAll(filepath.Join(src, "a/b"), 0o750)
	os.WriteFile(filepath.Join(src, "a/b/f"), []byte("content"), 0o600)
	os.Chown(filepath.Join(src, "a/b/f"), 1000, 1000)
	os.Symlink("/a/b/f", filepath.Join(src, "l"))
	os.Link(filepath.Join(src, "a/b/f"), filepath.Join(src, "hl"))
	out := filepath.Join(t.TempDir(), "disk.ext4")
	if err := BuildExt4(context.Background(), src, out, 16); err != nil {
		t.Fatal(err)
	}
	if fi, err := os.Stat(out); err != nil || fi.Size() != 16<<20 {
		t.Fatalf("image: %v %v", fi, err)
	}
	mnt := t.TempDir()
	if b, err := exec.Command("mount", "-o", "loop,ro", out, mnt).CombinedOutput(); err != nil {
		t.Skipf("cannot loop-mount here: %v %s", err, b)
	}
	defer exec.Command("umount", mnt).Run()
	got := strings.Join(tree(t, mnt), "\n")
	for _, want := range []string{"a/b/f -rw------- 1000:1000 content", "l Lrwxrwxrwx 0:0 -> /a/b/f", "hl -rw------- 1000:1000 content", "a drwxr-x---"} {
		if !strings.Contains(got, want) {
			t.Errorf("ext4 lacks %q:\n%s", want, got)
		}
	}
	if err := BuildExt4(context.Background(), src, out, 4); err == nil {
		t.Error("4 MiB accepted")
	}
}

// TestBusyboxImage builds an image from the host's static busybox (Debian
// busybox-static), pulls it from the in-process registry and runs commands
// chrooted into the resulting rootfs: the default user resolves.
func TestBusyboxImage(t *testing.T) {
	requireRoot(t)
	bb, err := os.ReadFile("/bin/busybox")
	if err != nil {
		t.Skip("needs /bin/busybox (Debian busybox-static)")
	}
	if out, err := exec.Command("/bin/busybox", "--list").Output(); err != nil || !strings.Contains(string(out), "id") {
		t.Skip("/bin/busybox is not a full busybox")
	}
	l := tarOf(t,
		ent{name: "bin/", typ: tar.TypeDir},
		ent{name: "bin/busybox", body: string(bb), mode: 0o755},
		ent{name: "bin/sh", typ: tar.TypeSymlink, link: "busybox"},
		ent{name: "etc/", typ: tar.TypeDir},
		ent{name: "etc/passwd", body: "root:x:0:0:root:/root:/bin/sh\n"},
		ent{name: "etc/group", body: "root:x:0:\n"},
	)
	img, err := mutate.AppendLayers(empty.Image, layerOf(t, l))
	if err != nil {
		t.Fatal(err)
	}
	host := serveRegistry(t, nil)
	push(t, host+"/busybox:1", withConfig(t, img, runtime.GOARCH))
	_, b, err := build(t, host+"/busybox:1", Options{}, &Store{Dir: t.TempDir()})
	if err != nil {
		t.Fatal(err)
	}
	out, err := exec.Command("chroot", b.RootFS, "/bin/busybox", "sh", "-c", "id user; ls -ld /home/user").CombinedOutput()
	if err != nil {
		t.Fatalf("chroot: %v\n%s", err, out)
	}
	if !strings.Contains(string(out), "uid=1000(user) gid=1000(user)") || !strings.Contains(string(out), "user") {
		t.Errorf("in the rootfs: %s", out)
	}
}
