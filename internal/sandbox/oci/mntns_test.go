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
	"time"

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
	ns = newLaunchNS(sandboxes, netnsDir, nil, false, nil, slog.New(slog.DiscardHandler))
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
		want := []string{filepath.Join(dir, "rootfs"), netns}
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

// TestLaunchNSTemplate checks the template's life: launches share one until it is
// ns.maxAge old, a sandbox mounted after it was built is still seen by its own launch
// (its mounts come from the node's namespace at launch time), and an unused template is
// closed.
func TestLaunchNSTemplate(t *testing.T) {
	sandboxes, netnsDir, ns := heldTree(t, 1)
	ns.maxAge = time.Hour
	mountsSeen := func(id string) string {
		t.Helper()
		dir := filepath.Join(sandboxes, id)
		var out bytes.Buffer
		cmd := exec.Command("cat", "/proc/self/mountinfo")
		cmd.Stdout = &out
		if err := ns.run(cmd, dir, filepath.Join(netnsDir, id)); err != nil || ns.off.Load() {
			t.Fatalf("run for %s: %v (fell back: %v)", id, err, ns.off.Load())
		}
		var mine []string
		for _, l := range strings.Split(strings.TrimSpace(out.String()), "\n") {
			if f := strings.Fields(l); len(f) > 4 && strings.HasPrefix(f[4], sandboxes) {
				mine = append(mine, strings.TrimPrefix(f[4], sandboxes))
			}
		}
		return strings.Join(mine, " ")
	}
	if got := mountsSeen("s0"); got != "/s0/rootfs" {
		t.Fatalf("s0's launch saw %q", got)
	}
	// The template's state, read as the launcher does (timers change it too).
	current := func() (cur *nsTemplate, users int) {
		ns.mu.Lock()
		defer ns.mu.Unlock()
		if ns.tmpl != nil {
			users = ns.tmpl.users
		}
		return ns.tmpl, users
	}
	first, users := current()
	if first == nil || users != 0 {
		t.Fatalf("after a launch the template is %v with %d users, want one with none", first, users)
	}
	// A sandbox mounted after the template was built.
	root := filepath.Join(sandboxes, "s9", "rootfs")
	if err := os.MkdirAll(root, 0o755); err != nil {
		t.Fatal(err)
	}
	if err := unix.Mount("tmpfs", root, "tmpfs", 0, "size=1m"); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = unix.Unmount(root, unix.MNT_DETACH) })
	nsFile := filepath.Join(netnsDir, "s9")
	if err := os.WriteFile(nsFile, nil, 0o444); err != nil {
		t.Fatal(err)
	}
	if err := unix.Mount("/proc/self/ns/net", nsFile, "", unix.MS_BIND, ""); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = unix.Unmount(nsFile, unix.MNT_DETACH) })
	if got := mountsSeen("s9"); got != "/s9/rootfs" {
		t.Errorf("s9's launch saw %q, want its own root only", got)
	}
	if cur, _ := current(); cur != first {
		t.Error("a second launch within maxAge built a new template")
	}
	// Past its age the next launch builds another, and the old one is closed.
	ns.mu.Lock()
	ns.maxAge = time.Millisecond
	ns.mu.Unlock()
	time.Sleep(2 * time.Millisecond)
	if got := mountsSeen("s0"); got != "/s0/rootfs" {
		t.Errorf("s0's second launch saw %q", got)
	}
	ns.mu.Lock()
	stale := first.stale
	ns.mu.Unlock()
	if !stale {
		t.Error("the template older than maxAge was not retired")
	}
	deadline := time.Now().Add(10 * time.Second)
	for {
		if cur, _ := current(); cur == nil {
			break
		}
		if time.Now().After(deadline) {
			t.Fatal("the template outlived its age")
		}
		time.Sleep(time.Millisecond)
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
	if ns := newLaunchNS(dir, "/nonexistent", nil, false, nil, slog.New(slog.DiscardHandler)); ns != nil {
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

// TestLaunchNSTemplateHolders checks that a template keeps no mount that holds a server,
// a device or a namespace (here a namespace file and an overlay outside the data
// directory), but keeps such a mount where a path launches use is (a keep path).
func TestLaunchNSTemplateHolders(t *testing.T) {
	sandboxes, netnsDir, ns := heldTree(t, 1)
	dir := t.TempDir()
	nsFile, lower, upper, work, ovl := filepath.Join(dir, "ns"), filepath.Join(dir, "lower"),
		filepath.Join(dir, "upper"), filepath.Join(dir, "work"), filepath.Join(dir, "ovl")
	for _, d := range []string{lower, upper, work, ovl} {
		if err := os.Mkdir(d, 0o755); err != nil {
			t.Fatal(err)
		}
	}
	if err := os.WriteFile(filepath.Join(lower, "envd"), []byte("x"), 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(nsFile, nil, 0o644); err != nil {
		t.Fatal(err)
	}
	if err := unix.Mount("/proc/self/ns/net", nsFile, "", unix.MS_BIND, ""); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = unix.Unmount(nsFile, unix.MNT_DETACH) })
	ovlMount := func() {
		if err := unix.Mount("overlay", ovl, "overlay", 0, "lowerdir="+lower+",upperdir="+upper+",workdir="+work); err != nil {
			t.Fatal(err)
		}
	}
	ovlMount()
	t.Cleanup(func() { _ = unix.Unmount(ovl, unix.MNT_DETACH) })
	seen := func() string {
		t.Helper()
		var out bytes.Buffer
		cmd := exec.Command("cat", "/proc/self/mountinfo")
		cmd.Stdout = &out
		if err := ns.run(cmd, filepath.Join(sandboxes, "s0"), filepath.Join(netnsDir, "s0")); err != nil || ns.off.Load() {
			t.Fatalf("run: %v (fell back: %v)", err, ns.off.Load())
		}
		return out.String()
	}
	out := seen()
	for _, p := range []string{nsFile, ovl} {
		if strings.Contains(out, " "+p+" ") {
			t.Errorf("a launch's namespace holds %s:\n%s", p, out)
		}
	}
	// A new template, where the overlay holds a path launches use.
	if err := ns.release(); err != nil {
		t.Fatal(err)
	}
	ns.keep = []string{filepath.Join(ovl, "envd")}
	out = seen()
	if !strings.Contains(out, " "+ovl+" ") {
		t.Errorf("a launch's namespace lacks %s, which a keep path is on:\n%s", ovl, out)
	}
	if strings.Contains(out, " "+nsFile+" ") {
		t.Errorf("a launch's namespace holds %s:\n%s", nsFile, out)
	}
}
