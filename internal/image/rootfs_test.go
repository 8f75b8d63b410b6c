package image

import (
	"archive/tar"
	"context"
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

func TestEnsureUser(t *testing.T) {
	cases := []struct {
		name          string
		passwd, group string
		wantUID       int
		wantPasswd    string // a line that must be in /etc/passwd afterwards
		wantGroupLine string
		wantHome      string
	}{
		{name: "fresh", passwd: "root:x:0:0::/root:/bin/sh\n", group: "root:x:0:\n", wantUID: 1000,
			wantPasswd: "user:x:1000:1000::/home/user:/bin/sh", wantGroupLine: "user:x:1000:", wantHome: "home/user"},
		{name: "uid-1000-taken", passwd: "root:x:0:0::/root:/bin/sh\nubuntu:x:1000:1000::/home/ubuntu:/bin/bash\n",
			group: "root:x:0:\nubuntu:x:1000:\n", wantUID: 1001,
			wantPasswd: "user:x:1001:1001::/home/user:/bin/sh", wantGroupLine: "user:x:1001:", wantHome: "home/user"},
		{name: "exists", passwd: "root:x:0:0::/root:/bin/sh\nuser:x:2000:2000::/work:/bin/sh", group: "user:x:2000:\n",
			wantUID: 2000, wantPasswd: "user:x:2000:2000::/work:/bin/sh", wantGroupLine: "user:x:2000:", wantHome: "work"},
		{name: "no-passwd", wantUID: 1000, wantPasswd: "user:x:1000:1000::/home/user:/bin/sh",
			wantGroupLine: "user:x:1000:", wantHome: "home/user"},
		{name: "group-exists", passwd: "root:x:0:0::/root:/bin/sh\n", group: "user:x:500:\n", wantUID: 1000,
			wantPasswd: "user:x:1000:500::/home/user:/bin/sh", wantGroupLine: "user:x:500:", wantHome: "home/user"},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			root := t.TempDir()
			os.MkdirAll(filepath.Join(root, "etc"), 0o755)
			if c.passwd != "" {
				os.WriteFile(filepath.Join(root, "etc/passwd"), []byte(c.passwd), 0o644)
			}
			if c.group != "" {
				os.WriteFile(filepath.Join(root, "etc/group"), []byte(c.group), 0o644)
			}
			uid, err := prepareRootFS(root, DefaultUser)
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
			fi, err := os.Stat(filepath.Join(root, c.wantHome))
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

// TestEnsureUserLinkOut: an image whose /etc/passwd links outside its root
// must not make the build write there.
func TestEnsureUserLinkOut(t *testing.T) {
	top := t.TempDir()
	outside := filepath.Join(top, "host-passwd")
	os.WriteFile(outside, []byte("root:x:0:0::/root:/bin/sh\n"), 0o644)
	root := filepath.Join(top, "root")
	os.MkdirAll(filepath.Join(root, "etc"), 0o755)
	os.Symlink(outside, filepath.Join(root, "etc/passwd"))
	_, err := prepareRootFS(root, DefaultUser)
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
