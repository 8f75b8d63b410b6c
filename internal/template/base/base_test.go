package base

import (
	"context"
	"errors"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
)

func needTools(t *testing.T) {
	t.Helper()
	for _, p := range []string{"/bin/busybox", "/bin/bash-static"} {
		if _, err := os.Stat(p); err != nil {
			t.Skipf("%s missing (install busybox-static and bash-static)", p)
		}
	}
}

func TestBuildLayout(t *testing.T) {
	needTools(t)
	out := filepath.Join(t.TempDir(), "base")
	if err := Build(context.Background(), Options{Out: out}); err != nil {
		t.Fatal(err)
	}
	if !Built(out) {
		t.Fatal("stamp missing after Build")
	}
	tests := []struct {
		path string
		mode os.FileMode // permission + sticky bits to check; 0 = only existence
		uid  int
	}{
		{"bin/bash", 0o755, 0},
		{"bin/busybox", 0o755, 0},
		{"tmp", 0o777 | os.ModeSticky, 0},
		{"home/user", 0o755, UserUID},
		{"root", 0o700, 0},
		{"etc/shadow", 0o640, 0},
		{"proc", 0, 0},
		{"sys", 0, 0},
		{"dev", 0, 0},
		{strings.TrimPrefix(EnvdMountpoint, "/"), 0o755, 0},
	}
	for _, tc := range tests {
		t.Run(tc.path, func(t *testing.T) {
			fi, err := os.Stat(filepath.Join(out, tc.path))
			if err != nil {
				t.Fatal(err)
			}
			if tc.mode != 0 && fi.Mode()&(os.ModePerm|os.ModeSticky) != tc.mode {
				t.Errorf("mode %v, want %v", fi.Mode(), tc.mode)
			}
			if uid := int(fi.Sys().(*syscall.Stat_t).Uid); uid != tc.uid {
				t.Errorf("uid %d, want %d", uid, tc.uid)
			}
		})
	}
	for _, link := range []string{"bin/ls", "usr/bin/wget", "bin/sh"} {
		if _, err := os.Readlink(filepath.Join(out, link)); err != nil {
			t.Errorf("%s: %v", link, err)
		}
	}
}

// TestBuildRunsBashLogin runs the SDK's command form inside the rootfs (chroot as root)
// to prove bash, the login profile, the accounts and the applets work together.
func TestBuildRunsBashLogin(t *testing.T) {
	needTools(t)
	if os.Geteuid() != 0 {
		t.Skip("chroot needs root")
	}
	out := filepath.Join(t.TempDir(), "base")
	if err := Build(context.Background(), Options{Out: out}); err != nil {
		t.Fatal(err)
	}
	cmd := exec.Command("chroot", "--userspec=1000:1000", out, "/bin/bash", "-l", "-c",
		`echo "$PATH"; id -un; cd ~ && pwd; echo hi > /tmp/x && cat /tmp/x; test -L /usr/bin/wget && echo ok`)
	cmd.Env = []string{"HOME=/home/user"}
	b, err := cmd.CombinedOutput()
	if err != nil {
		t.Fatalf("%v: %s", err, b)
	}
	want := "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin\nuser\n/home/user\nhi\nok\n"
	if string(b) != want {
		t.Fatalf("got %q, want %q", b, want)
	}
}

func TestBuildIdempotentAndForce(t *testing.T) {
	needTools(t)
	out := filepath.Join(t.TempDir(), "base")
	ctx := context.Background()
	if err := Build(ctx, Options{Out: out}); err != nil {
		t.Fatal(err)
	}
	marker := filepath.Join(out, "marker")
	if err := os.WriteFile(marker, nil, 0o644); err != nil {
		t.Fatal(err)
	}
	if err := Build(ctx, Options{Out: out}); err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(marker); err != nil {
		t.Fatal("second Build without Force replaced a finished build")
	}
	if err := Build(ctx, Options{Out: out, Force: true}); err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(marker); !os.IsNotExist(err) {
		t.Fatal("Force did not rebuild")
	}
	// No temp dirs left next to Out.
	ents, _ := os.ReadDir(filepath.Dir(out))
	if len(ents) != 1 {
		t.Fatalf("leftovers next to Out: %v", ents)
	}
}

func TestBuildBadInput(t *testing.T) {
	dir := t.TempDir()
	tests := []struct {
		name    string
		o       Options
		missing bool
	}{
		{"no out", Options{}, false},
		{"no busybox", Options{Out: filepath.Join(dir, "a"), Busybox: filepath.Join(dir, "nope")}, true},
		{"no bash", Options{Out: filepath.Join(dir, "b"), Busybox: "/bin/busybox", Bash: filepath.Join(dir, "nope")}, true},
		{"bash is dir", Options{Out: filepath.Join(dir, "c"), Busybox: "/bin/busybox", Bash: dir}, true},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			err := Build(context.Background(), tc.o)
			if err == nil {
				t.Fatal("want error")
			}
			if tc.missing && !errors.Is(err, ErrMissingTool) {
				t.Fatalf("want ErrMissingTool, got %v", err)
			}
			if tc.o.Out != "" {
				if _, err := os.Stat(tc.o.Out); !os.IsNotExist(err) {
					t.Fatal("failed Build created Out")
				}
			}
		})
	}
	ents, _ := os.ReadDir(dir)
	if len(ents) != 0 {
		t.Fatalf("failed builds left %v", ents)
	}
}
