package network

import (
	"errors"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"

	"golang.org/x/sys/unix"
)

// netnsDirChildEnv marks the re-executed test binary that runs in a private mount
// namespace (mounts made there never reach the host).
const netnsDirChildEnv = "AENV_NETNS_DIR_TEST_CHILD"

// TestPrepareNetnsDir runs testPrepareNetnsDir in a private mount namespace: a Go process
// cannot unshare its own (its threads share one filesystem context).
func TestPrepareNetnsDir(t *testing.T) {
	if os.Getenv(netnsDirChildEnv) != "" {
		testPrepareNetnsDir(t)
		return
	}
	needRoot(t)
	unshare, err := exec.LookPath("unshare")
	if err != nil {
		t.Skip("needs unshare(1) (util-linux)")
	}
	cmd := exec.Command(unshare, "--mount", "--propagation", "private", os.Args[0], "-test.run", "^TestPrepareNetnsDir$", "-test.v")
	cmd.Env = append(os.Environ(), netnsDirChildEnv+"=1")
	out, err := cmd.CombinedOutput()
	if err != nil || !strings.Contains(string(out), "--- PASS: TestPrepareNetnsDir") {
		t.Fatalf("child: %v\n%s", err, out)
	}
}

func testPrepareNetnsDir(t *testing.T) {
	base := t.TempDir()
	// Runs before TempDir's removal: detach everything mounted below base, deepest first.
	t.Cleanup(func() {
		for range 3 { // a detached mount can uncover another
			m, _ := mountsBelow(base)
			for i := len(m) - 1; i >= 0; i-- {
				unix.Unmount(m[i], unix.MNT_DETACH)
			}
		}
	})
	// bindFile mounts a file at dir/name, standing in for a namespace's bind mount.
	bindFile := func(dir, name string) string {
		t.Helper()
		src := filepath.Join(base, "src-"+name)
		dst := filepath.Join(dir, name)
		for _, p := range []string{src, dst} {
			if err := os.WriteFile(p, nil, 0o444); err != nil {
				t.Fatal(err)
			}
		}
		if err := unix.Mount(src, dst, "none", unix.MS_BIND, ""); err != nil {
			t.Fatal(err)
		}
		return dst
	}
	// iproute2 is what `ip netns add` does to the directory on first use.
	iproute2 := func(dir string) {
		t.Helper()
		if err := unix.Mount("", dir, "none", unix.MS_SHARED|unix.MS_REC, ""); errors.Is(err, unix.EINVAL) {
			if err := unix.Mount(dir, dir, "none", unix.MS_BIND|unix.MS_REC, ""); err != nil {
				t.Fatal(err)
			}
		} else if err != nil {
			t.Fatal(err)
		}
	}
	remove := func(p string) error {
		if err := unix.Unmount(p, unix.MNT_DETACH); err != nil {
			return err
		}
		return os.Remove(p)
	}

	// The hazard: a plain directory with a namespace mount, then `ip netns add`.
	plain := filepath.Join(base, "plain")
	os.Mkdir(plain, 0o755)
	ns := bindFile(plain, "a")
	iproute2(plain)
	if err := remove(ns); !errors.Is(err, unix.EBUSY) {
		t.Fatalf("removing a namespace hidden by iproute2's bind = %v, want EBUSY (the hazard this guards against)", err)
	}

	// A directory that already holds mounts is left alone.
	busy := filepath.Join(base, "busy")
	os.Mkdir(busy, 0o755)
	old := bindFile(busy, "a")
	if err := prepareNetnsDir(busy); !errors.Is(err, errNetnsDirBusy) {
		t.Fatalf("prepare of a directory with mounts = %v, want errNetnsDirBusy", err)
	}
	if err := remove(old); err != nil {
		t.Fatalf("the existing mount was disturbed: %v", err)
	}

	// Prepared first, the directory survives `ip netns add`: namespaces stay removable.
	dir := filepath.Join(base, "netns")
	if err := prepareNetnsDir(dir); err != nil {
		t.Fatal(err)
	}
	if err := prepareNetnsDir(dir); err != nil {
		t.Fatalf("second prepare: %v", err)
	}
	if !sharedMountPoint(t, dir) {
		t.Fatalf("%s is not a shared mount point after prepare", dir)
	}
	ns = bindFile(dir, "b")
	iproute2(dir)
	if err := remove(ns); err != nil {
		t.Fatalf("namespace mount not removable after iproute2's setup: %v", err)
	}
}

// sharedMountPoint reports whether dir is a mount point with shared propagation.
func sharedMountPoint(t *testing.T, dir string) bool {
	raw, err := os.ReadFile("/proc/self/mountinfo")
	if err != nil {
		t.Fatal(err)
	}
	for _, l := range strings.Split(string(raw), "\n") {
		f := strings.Fields(l)
		if len(f) > 6 && f[4] == dir && strings.Contains(strings.Join(f[6:], " "), "shared:") {
			return true
		}
	}
	return false
}
