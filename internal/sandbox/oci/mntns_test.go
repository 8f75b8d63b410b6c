package oci

import (
	"bytes"
	"fmt"
	"log/slog"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"

	"golang.org/x/sys/unix"
)

// heldTree makes a sandboxes directory and a netns directory under a temporary dir, each
// a mount point of its own, with held sandboxes: each a tmpfs "root" and a network
// namespace mount, like the node's.
func heldTree(t *testing.T, held int) (sandboxes, netnsDir string, ns *launchNS) {
	t.Helper()
	if os.Geteuid() != 0 {
		t.Skip("needs root")
	}
	base := t.TempDir()
	sandboxes, netnsDir = filepath.Join(base, "sandboxes"), filepath.Join(base, "netns")
	var mounted []string
	t.Cleanup(func() {
		for i := len(mounted) - 1; i >= 0; i-- {
			if err := unix.Unmount(mounted[i], unix.MNT_DETACH); err != nil {
				t.Errorf("unmount %s: %v", mounted[i], err)
			}
		}
	})
	for _, d := range []string{sandboxes, netnsDir} {
		if err := os.MkdirAll(d, 0o755); err != nil {
			t.Fatal(err)
		}
	}
	if err := unix.Mount(netnsDir, netnsDir, "", unix.MS_BIND, ""); err != nil {
		t.Fatal(err)
	}
	mounted = append(mounted, netnsDir)
	ns = newLaunchNS(sandboxes, netnsDir, slog.New(slog.DiscardHandler))
	if ns == nil || ns.netnsDir != netnsDir {
		t.Fatalf("launcher %+v, want one with netns dir %s", ns, netnsDir)
	}
	mounted = append(mounted, sandboxes)
	for k := range held {
		root := filepath.Join(sandboxes, fmt.Sprint("s", k), "rootfs")
		if err := os.MkdirAll(root, 0o755); err != nil {
			t.Fatal(err)
		}
		if err := unix.Mount("tmpfs", root, "tmpfs", 0, "size=1m"); err != nil {
			t.Fatal(err)
		}
		mounted = append(mounted, root)
		f := filepath.Join(netnsDir, fmt.Sprint("s", k))
		if err := os.WriteFile(f, nil, 0o444); err != nil {
			t.Fatal(err)
		}
		if err := unix.Mount("/proc/self/ns/net", f, "", unix.MS_BIND, ""); err != nil {
			t.Fatal(err)
		}
		mounted = append(mounted, f)
	}
	return sandboxes, netnsDir, ns
}

// TestLaunchNSMountTable checks that a command run for one sandbox sees its own mounts
// and none of the others': its mount lines do not grow with the sandboxes held.
func TestLaunchNSMountTable(t *testing.T) {
	for _, held := range []int{2, 200} {
		t.Run(fmt.Sprint(held), func(t *testing.T) { launchNSMountTable(t, held) })
	}
}

func launchNSMountTable(t *testing.T, held int) {
	{
		sandboxes, netnsDir, ns := heldTree(t, held)
		hostTable, err := os.ReadFile("/proc/self/mountinfo")
		if err != nil {
			t.Fatal(err)
		}
		dir, netns := filepath.Join(sandboxes, "s1"), filepath.Join(netnsDir, "s1")
		var out bytes.Buffer
		cmd := exec.Command("cat", "/proc/self/mountinfo")
		cmd.Stdout = &out
		if err := ns.run(cmd, dir, netns); err != nil {
			t.Fatal(err)
		}
		if ns.off.Load() {
			t.Fatal("the launcher fell back to the host's namespace")
		}
		var mine []string
		for _, l := range strings.Split(strings.TrimSpace(out.String()), "\n") {
			if f := strings.Fields(l); len(f) > 4 && (strings.HasPrefix(f[4], sandboxes) || strings.HasPrefix(f[4], netnsDir)) {
				mine = append(mine, f[4])
			}
		}
		want := []string{dir, filepath.Join(dir, "rootfs"), netns}
		if strings.Join(mine, " ") != strings.Join(want, " ") {
			t.Errorf("%d held: the command saw mounts %v, want %v", held, mine, want)
		}
		// The host's table less the held sandboxes' 2 lines each, give or take what other
		// processes on the host mounted meanwhile.
		if seen, host := strings.Count(out.String(), "\n"), strings.Count(string(hostTable), "\n"); seen > host-2*held+20 {
			t.Errorf("%d held: the command saw %d mount lines, the node %d", held, seen, host)
		}
		// Nothing reached the node's namespace: every sandbox's mounts are still there.
		if m, _ := mountsUnder(sandboxes); len(m) != held+1 {
			t.Errorf("%d held: the node sees %d mounts under %s after the run, want %d", held, len(m), sandboxes, held+1)
		}
		if err := ns.run(exec.Command("test", "-s", filepath.Join(dir, "rootfs", "x")), dir, netns); err == nil {
			t.Errorf("%d held: a file appeared in the sandbox's root", held)
		}
	}
}

// TestLaunchNSBusyDir checks the restart case: a sandboxes directory that is not a mount
// point but holds mounts is left alone, and commands run in the node's namespace.
func TestLaunchNSBusyDir(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("needs root")
	}
	dir := filepath.Join(t.TempDir(), "sandboxes")
	root := filepath.Join(dir, "s0", "rootfs")
	if err := os.MkdirAll(root, 0o755); err != nil {
		t.Fatal(err)
	}
	if err := unix.Mount("tmpfs", root, "tmpfs", 0, "size=1m"); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = unix.Unmount(root, unix.MNT_DETACH) })
	if ns := newLaunchNS(dir, "/nonexistent", slog.New(slog.DiscardHandler)); ns != nil {
		t.Fatalf("launcher %+v over a directory holding mounts, want none", ns)
	}
	if m, _ := mountsUnder(dir); len(m) != 1 || m[0] != root {
		t.Errorf("mounts under %s: %v, want only %s", dir, m, root)
	}
	var ns *launchNS
	if err := ns.run(exec.Command("true"), filepath.Join(dir, "s0"), ""); err != nil {
		t.Errorf("a nil launcher: %v", err)
	}
}
