package rootfs

import (
	"context"
	"errors"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/aenv-dev/aenv/internal/storage/blockdev"
	"github.com/aenv-dev/aenv/internal/storage/stack"
	"golang.org/x/sys/unix"
)

// overlayEnv is a template layer, its shared lower and an empty upper layer.
type overlayEnv struct {
	dir    string
	base   stack.LayerRef
	empty  stack.LayerRef
	lowers *Lowers
}

func newOverlayEnv(t *testing.T) *overlayEnv {
	t.Helper()
	needBlock(t)
	dir := t.TempDir()
	e := &overlayEnv{dir: dir, lowers: NewLowers(filepath.Join(dir, "lowers"), nil, nil)}
	e.base = baseLayer(t, dir, 64, map[string]string{"etc/conf": "template", "d/x": "x", "d/y": "y"})
	var err error
	if e.empty, err = EmptyUpper(context.Background(), filepath.Join(dir, "uppers"), 64); err != nil {
		t.Fatal(err)
	}
	return e
}

// acquire holds the template's lower for the test.
func (e *overlayEnv) acquire(t *testing.T) *SharedLower {
	t.Helper()
	l, err := e.lowers.Acquire(context.Background(), []stack.LayerRef{e.base})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { e.lowers.Release(l) })
	return l
}

func (e *overlayEnv) open(t *testing.T, name string, l *SharedLower, upper []stack.LayerRef, userns, rootID int) *Overlay {
	t.Helper()
	o, err := e.lowers.OpenOverlay(context.Background(), OverlaySpec{Dir: filepath.Join(e.dir, name), Lower: l, Upper: upper,
		Target: filepath.Join(e.dir, name, "root"), UserNS: userns, RootID: rootID})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if err := o.Close(); err != nil {
			t.Errorf("close %s: %v", name, err)
		}
	})
	return o
}

func readFile(t *testing.T, path string) string {
	t.Helper()
	b, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	return string(b)
}

func isMount(t *testing.T, dir string) bool {
	t.Helper()
	raw, err := os.ReadFile("/proc/self/mountinfo")
	if err != nil {
		t.Fatal(err)
	}
	for _, line := range strings.Split(string(raw), "\n") {
		if f := strings.Fields(line); len(f) > 4 && f[4] == dir {
			return true
		}
	}
	return false
}

// TestOverlaySnapshotAndFork: two roots over one lower keep their writes apart and
// leave the lower as it was; a snapshot of one, opened again over the same lower, has
// its new, changed, removed and renamed files, and the root it came from goes on.
func TestOverlaySnapshotAndFork(t *testing.T) {
	e := newOverlayEnv(t)
	ctx := context.Background()
	l := e.acquire(t)
	a := e.open(t, "a", l, []stack.LayerRef{e.empty}, -1, -1)
	b := e.open(t, "b", l, []stack.LayerRef{e.empty}, -1, -1)
	ra, rb := filepath.Join(e.dir, "a", "root"), filepath.Join(e.dir, "b", "root")

	must := func(err error) {
		t.Helper()
		if err != nil {
			t.Fatal(err)
		}
	}
	must(os.WriteFile(filepath.Join(ra, "new"), []byte("a's"), 0o644))
	must(os.WriteFile(filepath.Join(ra, "etc/conf"), []byte("changed"), 0o644))
	must(os.Remove(filepath.Join(ra, "d/x")))
	must(os.Rename(filepath.Join(ra, "d"), filepath.Join(ra, "moved"))) // a lower directory
	if got := readFile(t, filepath.Join(rb, "etc/conf")); got != "template" {
		t.Fatalf("b sees a's write: %q", got)
	}
	if _, err := os.Stat(filepath.Join(rb, "new")); !errors.Is(err, os.ErrNotExist) {
		t.Fatalf("b sees a's new file: %v", err)
	}
	if got := readFile(t, filepath.Join(l.Path(), "etc/conf")); got != "template" {
		t.Fatalf("the lower changed: %q", got)
	}
	if err := os.WriteFile(filepath.Join(l.Path(), "w"), nil, 0o644); err == nil {
		t.Fatal("the shared lower is writable")
	}

	upper, _, err := a.Snapshot(ctx, filepath.Join(e.dir, "snap.commit"), QuiesceFreeze)
	must(err)
	if len(upper) != 2 || upper[0] != e.empty {
		t.Fatalf("snapshot's upper layers = %+v, want the empty upper and one sealed layer", upper)
	}
	must(os.WriteFile(filepath.Join(ra, "after"), []byte("1"), 0o644)) // the source goes on
	c := e.open(t, "c", l, upper, -1, -1)
	rc := filepath.Join(e.dir, "c", "root")
	for name, want := range map[string]string{"new": "a's", "etc/conf": "changed", "moved/y": "y"} {
		if got := readFile(t, filepath.Join(rc, name)); got != want {
			t.Errorf("fork's %s = %q, want %q", name, got, want)
		}
	}
	for _, gone := range []string{"d", "moved/x", "after"} {
		if _, err := os.Stat(filepath.Join(rc, gone)); !errors.Is(err, os.ErrNotExist) {
			t.Errorf("fork has %s: %v", gone, err)
		}
	}
	_ = c
	_ = b
}

// TestLowersShared: Acquires of one stack share a mount, also when concurrent; the last
// Release (an overlay's Close included) unmounts it and removes its directory; bad
// input is refused and mounts nothing.
func TestLowersShared(t *testing.T) {
	e := newOverlayEnv(t)
	ctx := context.Background()
	if _, err := e.lowers.Acquire(ctx, nil); err == nil {
		t.Fatal("Acquire of no layers succeeded")
	}
	got := make([]*SharedLower, 8)
	var wg sync.WaitGroup
	for i := range got {
		wg.Go(func() {
			l, err := e.lowers.Acquire(ctx, []stack.LayerRef{e.base})
			if err != nil {
				t.Error(err)
			}
			got[i] = l
		})
	}
	wg.Wait()
	if t.Failed() {
		t.FailNow()
	}
	path := got[0].Path()
	for _, l := range got {
		if l != got[0] {
			t.Fatalf("concurrent Acquires mounted the stack more than once: %s, %s", l.Path(), path)
		}
	}
	o, err := e.lowers.OpenOverlay(ctx, OverlaySpec{Dir: filepath.Join(e.dir, "o"), Lower: got[0], Upper: []stack.LayerRef{e.empty},
		Target: filepath.Join(e.dir, "o", "root"), UserNS: -1})
	if err != nil {
		t.Fatal(err)
	}
	for _, l := range got {
		if err := e.lowers.Release(l); err != nil {
			t.Fatal(err)
		}
	}
	if !isMount(t, path) {
		t.Fatal("lower unmounted while an overlay root uses it")
	}
	if got := readFile(t, filepath.Join(e.dir, "o", "root", "etc/conf")); got != "template" {
		t.Fatalf("overlay reads %q", got)
	}
	if err := o.Close(); err != nil {
		t.Fatal(err)
	}
	if isMount(t, path) {
		t.Fatal("lower still mounted after its last user went")
	}
	if _, err := os.Stat(filepath.Dir(path)); !errors.Is(err, os.ErrNotExist) {
		t.Fatalf("lower's directory left: %v", err)
	}
	if _, err := e.lowers.OpenOverlay(ctx, OverlaySpec{Dir: filepath.Join(e.dir, "p"), Lower: got[0], Upper: []stack.LayerRef{e.empty},
		Target: filepath.Join(e.dir, "p", "root"), UserNS: -1}); err == nil {
		t.Fatal("overlay over a released lower opened")
	}
}

// TestOverlayBadInput: an overlay without a lower or upper layers, or with upper layers
// that are not an upper filesystem, is refused and leaves nothing mounted.
func TestOverlayBadInput(t *testing.T) {
	e := newOverlayEnv(t)
	ctx := context.Background()
	l := e.acquire(t)
	for name, spec := range map[string]OverlaySpec{
		"no lower":          {Upper: []stack.LayerRef{e.empty}},
		"no upper":          {Lower: l},
		"template as upper": {Lower: l, Upper: []stack.LayerRef{e.base}},
	} {
		spec.Dir, spec.Target, spec.UserNS = filepath.Join(e.dir, "bad"), filepath.Join(e.dir, "bad", "root"), -1
		if _, err := e.lowers.OpenOverlay(ctx, spec); err == nil {
			t.Errorf("%s: opened", name)
		}
		raw, _ := os.ReadFile("/proc/self/mountinfo")
		if strings.Contains(string(raw), filepath.Join(e.dir, "bad")) {
			t.Fatalf("%s: mounts left under %s", name, filepath.Join(e.dir, "bad"))
		}
	}
	if !isMount(t, l.Path()) {
		t.Fatal("a refused overlay released the caller's use of the lower")
	}
}

// TestOverlayIDMapped: with a user namespace, the lower's and the upper's files appear
// owned by the namespace's root on the host, and that user writes the root.
func TestOverlayIDMapped(t *testing.T) {
	e := newOverlayEnv(t)
	if _, err := exec.LookPath("setpriv"); err != nil {
		t.Skip("needs setpriv (util-linux)")
	}
	const hostRoot = 200000
	cmd := exec.Command("sleep", "60")
	cmd.SysProcAttr = &syscall.SysProcAttr{
		Cloneflags:  syscall.CLONE_NEWUSER,
		UidMappings: []syscall.SysProcIDMap{{ContainerID: 0, HostID: hostRoot, Size: 65536}},
		GidMappings: []syscall.SysProcIDMap{{ContainerID: 0, HostID: hostRoot, Size: 65536}},
	}
	if err := cmd.Start(); err != nil {
		t.Skipf("no user namespace: %v", err)
	}
	t.Cleanup(func() { cmd.Process.Kill(); cmd.Wait() })
	ns, err := unix.Open("/proc/"+strconv.Itoa(cmd.Process.Pid)+"/ns/user", unix.O_RDONLY|unix.O_CLOEXEC, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer unix.Close(ns)
	// The test's temporary directories are 0700; the namespace's root walks through them.
	for _, d := range []string{filepath.Dir(e.dir), e.dir} {
		if err := os.Chmod(d, 0o755); err != nil {
			t.Fatal(err)
		}
	}
	l := e.acquire(t)
	m := e.open(t, "m", l, []stack.LayerRef{e.empty}, ns, hostRoot)
	root := filepath.Join(e.dir, "m", "root")
	// The mount's credentials stayed on the thread that made it.
	tasks, _ := filepath.Glob("/proc/self/task/*/status")
	for _, task := range tasks {
		raw, _ := os.ReadFile(task)
		for _, line := range strings.Split(string(raw), "\n") {
			if f := strings.Fields(line); len(f) == 5 && (f[0] == "Uid:" || f[0] == "Gid:") && f[4] != "0" {
				t.Fatalf("%s: %s", task, line)
			}
		}
	}
	for _, p := range []string{root, filepath.Join(root, "etc/conf")} {
		var st unix.Stat_t
		if err := unix.Stat(p, &st); err != nil {
			t.Fatal(err)
		}
		if st.Uid != hostRoot {
			t.Errorf("%s owned by %d, want %d", p, st.Uid, hostRoot)
		}
	}
	out, err := exec.Command("setpriv", "--reuid", strconv.Itoa(hostRoot), "--regid", strconv.Itoa(hostRoot), "--clear-groups",
		"sh", "-c", "echo mine > "+root+"/etc/conf && echo new > "+root+"/n && rm "+root+"/d/x").CombinedOutput()
	if err != nil {
		t.Fatalf("the namespace's root cannot write its root: %v: %s", err, out)
	}
	if got := readFile(t, filepath.Join(l.Path(), "etc/conf")); got != "template" {
		t.Fatalf("the lower changed: %q", got)
	}
	// On disk the upper holds the sandbox's ids from 0, so a snapshot opens in any slot.
	upper, _, err := m.Snapshot(context.Background(), filepath.Join(e.dir, "m.commit"), QuiesceFreeze)
	if err != nil {
		t.Fatal(err)
	}
	e.open(t, "plain", l, upper, -1, -1)
	for _, name := range []string{"etc/conf", "n", "etc"} {
		var st unix.Stat_t
		if err := unix.Stat(filepath.Join(e.dir, "plain", "root", name), &st); err != nil {
			t.Fatal(err)
		}
		if st.Uid != 0 || st.Gid != 0 {
			t.Errorf("%s stored as %d:%d, want 0:0", name, st.Uid, st.Gid)
		}
	}
	if got := readFile(t, filepath.Join(e.dir, "plain", "root", "etc/conf")); got != "mine\n" {
		t.Errorf("snapshot's etc/conf = %q", got)
	}
	if _, err := os.Stat(filepath.Join(e.dir, "plain", "root", "d/x")); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("snapshot has the removed d/x: %v", err)
	}
}

// TestOverlayAdopt: overlay roots and their lowers, served by a data plane, outlive the
// process that opened them. A new one adopts every lower, then the roots over them, then
// releases its adoption of the lowers: a lower that no root was adopted over goes, the
// others stay, and the adopted roots read and write as before and close cleanly. An
// overlay root with the wrong upper disk is refused and nothing changes.
func TestOverlayAdopt(t *testing.T) {
	e := newOverlayEnv(t)
	ctx := context.Background()
	c, _ := startDataPlane(t)
	open := RemoteOpener(c)
	lowersDir := filepath.Join(e.dir, "lowers")
	e.lowers = NewLowers(lowersDir, open, nil)
	other := baseLayer(t, t.TempDir(), 32, map[string]string{"o": "other"})

	l, err := e.lowers.Acquire(ctx, []stack.LayerRef{e.base})
	if err != nil {
		t.Fatal(err)
	}
	unused, err := e.lowers.Acquire(ctx, []stack.LayerRef{other})
	if err != nil {
		t.Fatal(err)
	}
	spec := func(name string, l *SharedLower) OverlaySpec {
		return OverlaySpec{Dir: filepath.Join(e.dir, name), Target: filepath.Join(e.dir, name, "root"), Lower: l,
			Upper: []stack.LayerRef{e.empty}, UserNS: -1, Open: open}
	}
	var roots []*Overlay
	for _, name := range []string{"a", "b"} {
		o, err := e.lowers.OpenOverlay(ctx, spec(name, l))
		if err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(filepath.Join(e.dir, name, "root", "w"), []byte(name), 0o644); err != nil {
			t.Fatal(err)
		}
		roots = append(roots, o)
	}
	// A root over the other lower that will not be adopted (its container died with the
	// node): its overlay still holds that lower when the adoption releases it.
	gone, err := e.lowers.OpenOverlay(ctx, spec("c", unused))
	if err != nil {
		t.Fatal(err)
	}
	// The crash.
	for _, o := range append(roots, gone) {
		o.Abandon()
	}
	e.lowers.Abandon()

	ls := NewLowers(lowersDir, open, nil)
	infos, err := c.List(ctx)
	if err != nil {
		t.Fatal(err)
	}
	mounts, err := blockdev.ReadMounts()
	if err != nil {
		t.Fatal(err)
	}
	disks := map[string]ServedDisk{}
	var adopted []*SharedLower
	for _, info := range infos {
		disks[info.Dir] = c.Attach(info)
		if filepath.Dir(info.Dir) == lowersDir {
			al, err := ls.Adopt(c.Attach(info), mounts)
			if err != nil {
				t.Fatal(err)
			}
			adopted = append(adopted, al)
		}
	}
	if len(adopted) != 2 {
		t.Fatalf("adopted %d lowers, want 2", len(adopted))
	}
	var lower *SharedLower
	for _, al := range adopted {
		if al.Path() == l.Path() {
			lower = al
		}
	}
	if lower == nil {
		t.Fatal("the roots' lower was not adopted")
	}
	sa, sb := spec("a", lower), spec("b", lower)
	if _, err := ls.AdoptOverlay(sa, disks[sb.upperDir()], mounts); err == nil {
		t.Fatal("an overlay root adopted with another root's upper disk")
	}
	var back []*Overlay
	for _, s := range []OverlaySpec{sa, sb} {
		o, err := ls.AdoptOverlay(s, disks[s.upperDir()], mounts)
		if err != nil {
			t.Fatal(err)
		}
		back = append(back, o)
	}
	for _, al := range adopted {
		// The lower under root c goes too: its disk once c's overlay lets go of it.
		if err := ls.Release(al); err != nil {
			t.Fatal(err)
		}
	}
	if isMount(t, unused.Path()) {
		t.Fatal("a lower no root was adopted over is still mounted")
	}
	// What the backend's reconcile does with a root it did not adopt.
	sc := spec("c", unused)
	for _, p := range []string{sc.Target, filepath.Join(sc.Dir, "upperfs")} {
		if err := unix.Unmount(p, unix.MNT_DETACH); err != nil {
			t.Fatalf("detach %s: %v", p, err)
		}
	}
	if err := c.Close(ctx, sc.upperDir()); err != nil {
		t.Fatal(err)
	}
	if !isMount(t, lower.Path()) {
		t.Fatal("the adopted roots' lower was unmounted")
	}
	for n, name := range []string{"a", "b"} {
		root := filepath.Join(e.dir, name, "root")
		if got := readFile(t, filepath.Join(root, "w")); got != name {
			t.Errorf("%s reads %q after adoption", name, got)
		}
		if err := os.WriteFile(filepath.Join(root, "after"), []byte("x"), 0o644); err != nil {
			t.Errorf("%s: write after adoption: %v", name, err)
		}
		if err := back[n].Close(); err != nil {
			t.Fatal(err)
		}
	}
	if raw, _ := os.ReadFile("/proc/self/mountinfo"); strings.Contains(string(raw), e.dir) {
		t.Fatalf("mounts left under %s", e.dir)
	}
	// The unused lower's disk closes once the last of root c lets go of its loop device.
	deadline := time.Now().Add(10 * time.Second)
	for {
		infos, err := c.List(ctx)
		if err == nil && len(infos) == 0 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("the data plane still serves %d disks (%v)", len(infos), err)
		}
		time.Sleep(20 * time.Millisecond)
	}
}
