package oci

import (
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/aenv-dev/aenv/internal/sandbox"
	"golang.org/x/sys/unix"
)

func TestCheckMountPoints(t *testing.T) {
	cases := []struct {
		name       string
		make       func(dir string) error
		resolvConf bool
		ok         bool
	}{
		{"complete", nil, true, true},
		{"no resolv.conf, none configured", func(d string) error { return os.Remove(filepath.Join(d, "etc/resolv.conf")) }, false, true},
		{"no resolv.conf", func(d string) error { return os.Remove(filepath.Join(d, "etc/resolv.conf")) }, true, false},
		{"no envd file", func(d string) error { return os.Remove(filepath.Join(d, envdMount)) }, true, false},
		{"envd is a directory", func(d string) error {
			p := filepath.Join(d, envdMount)
			return errors.Join(os.Remove(p), os.Mkdir(p, 0o755))
		}, true, false},
		{"proc is a symlink", func(d string) error {
			p := filepath.Join(d, "proc")
			return errors.Join(os.Remove(p), os.Symlink("/proc", p))
		}, true, false},
		{"no dev", func(d string) error { return os.Remove(filepath.Join(d, "dev")) }, true, false},
		{"a directory on the way is a symlink", func(d string) error {
			return errors.Join(os.Rename(filepath.Join(d, ".aenv"), filepath.Join(d, "elsewhere")),
				os.Symlink("elsewhere", filepath.Join(d, ".aenv")))
		}, true, false},
		{"etc is a symlink, no resolv.conf configured", func(d string) error {
			return errors.Join(os.Rename(filepath.Join(d, "etc"), filepath.Join(d, "elsewhere")),
				os.Symlink("elsewhere", filepath.Join(d, "etc")))
		}, false, true},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			dir := t.TempDir()
			for _, p := range []string{"proc", "dev", "sys", "etc", ".aenv"} {
				if err := os.Mkdir(filepath.Join(dir, p), 0o755); err != nil {
					t.Fatal(err)
				}
			}
			for _, p := range []string{envdMount, "/etc/resolv.conf"} {
				if err := os.WriteFile(filepath.Join(dir, p), nil, 0o644); err != nil {
					t.Fatal(err)
				}
			}
			if c.make != nil {
				if err := c.make(dir); err != nil {
					t.Fatal(err)
				}
			}
			points, err := checkMountPoints(dir, c.resolvConf)
			if (err == nil) != c.ok || err != nil && !errors.Is(err, errNoMountPoint) {
				t.Fatalf("checkMountPoints: %v, want ok=%v", err, c.ok)
			}
			if want := 4 + map[bool]int{true: 1}[c.resolvConf]; c.ok && len(points) != want {
				t.Fatalf("mount points %v, want %d", points, want)
			}
		})
	}
}

var (
	waitInitOnce sync.Once
	waitInitBin  string
	waitInitErr  error
)

// waitInit builds testdata/waitinit once per test binary and returns the init arguments
// of the tests' containers: httpdInit, run by waitinit once the root's busybox is there
// (in a blank warm container, once it is on its root).
func waitInit(t *testing.T) []string {
	t.Helper()
	waitInitOnce.Do(func() {
		_, file, _, _ := runtime.Caller(0)
		waitInitBin = filepath.Join(os.TempDir(), fmt.Sprintf("aenv-oci-waitinit-%d", os.Getpid()))
		cmd := exec.Command("go", "build", "-o", waitInitBin, "./testdata/waitinit")
		cmd.Dir = filepath.Dir(file)
		cmd.Env = append(os.Environ(), "CGO_ENABLED=0")
		if out, err := cmd.CombinedOutput(); err != nil {
			waitInitErr = fmt.Errorf("build waitinit: %w: %s", err, out)
		}
	})
	if waitInitErr != nil {
		t.Fatal(waitInitErr)
	}
	return append([]string{envdMount}, httpdInit...)
}

// mountTable is what a sandbox's mount table looks like from inside: each mount point
// with its filesystem type and its options, sorted.
const mountTable = `awk '{ for (i = 7; $i != "-"; i++); print $5, $(i+1), $6 }' /proc/self/mountinfo | sort`

// TestBlankWarmFork: a fork's child comes from a blank warm container (wanted since the
// source's launch missed its template's pool) moved onto the capture's root: it sees the
// source's files, its init runs on that root, its mounts are those of a container runc
// made, its writes land in its own upper, and it can be forked in turn.
func TestBlankWarmFork(t *testing.T) { eachRuntime(t, testBlankWarmFork) }

func testBlankWarmFork(t *testing.T, runtime string) {
	needRuntime(t)
	needBlock(t)
	e := newTestBackend(t, func(c *Config) { c.WarmContainers, c.Runtime = 1, runtime })
	ctx := context.Background()
	a := e.launchBlock(t, "bl-a", testLayered(t), sandbox.Resources{})
	if a.cid != a.id {
		t.Fatalf("first launch came from container %s with no pool filled yet", a.cid)
	}
	e.mustSh(t, a, "echo pinned > /root/state && sync -f /")
	fork := func(src *Instance, id string) *Instance {
		t.Helper()
		res, err := src.Fork(ctx, []sandbox.ForkSpec{{SandboxID: id}})
		if err != nil {
			t.Fatal(err)
		}
		if res[0].Err != nil {
			t.Fatal(res[0].Err)
		}
		k := res[0].Instance.(*Instance)
		e.waitReady(t, k)
		return k
	}
	waitWarm(t, e.b, blankKey, 1)
	waitFilled(t, e.b) // the template's pool too: its containers take namespaces
	made := usernsMade(e.b)
	k := fork(a, "bl-warm")
	if !strings.HasPrefix(k.cid, "warm.") {
		t.Fatalf("child after the pool filled: container %s, not a blank warm one", k.cid)
	}
	// Its root is id-mapped with the namespace the runtime made for the container, and
	// the blank container that replaces it in the pool needs none.
	waitWarm(t, e.b, blankKey, 1)
	if n := usernsMade(e.b); k.idmap != nil && n != made {
		t.Fatalf("moving the blank container and refilling the pool made %d user namespaces", n-made)
	}
	if out := e.mustSh(t, k, "cat /root/state /proc/1/root/root/state; hostname"); out != "pinned\npinned\n"+sandbox.Hostname("bl-warm")+"\n" {
		t.Fatalf("blank child sees %q", out)
	}
	want, got := e.mustSh(t, a, mountTable), e.mustSh(t, k, mountTable)
	if got != want {
		t.Fatalf("blank child's mounts:\n%s\nwant (as runc made them):\n%s", got, want)
	}
	if strings.Contains(got, stageDir) || !strings.Contains(got, envdMount) {
		t.Fatalf("blank child's mounts:\n%s", got)
	}
	e.mustSh(t, k, "echo child > /root/child && sync -f /")
	if b, err := os.ReadFile(filepath.Join(k.l.rootfs(), "root/child")); err != nil || string(b) != "child\n" {
		t.Fatalf("child's write on the host: %q, %v", b, err)
	}
	if _, err := os.Stat(filepath.Join(e.b.blankRoot, "root")); !errors.Is(err, os.ErrNotExist) {
		t.Fatalf("blank root written to: %v", err)
	}
	waitWarm(t, e.b, blankKey, 1)
	g := fork(k, "bl-grandchild")
	if !strings.HasPrefix(g.cid, "warm.") {
		t.Fatalf("grandchild: container %s, not a blank warm one", g.cid)
	}
	if out := e.mustSh(t, g, "cat /root/state /root/child"); out != "pinned\nchild\n" {
		t.Fatalf("grandchild sees %q", out)
	}
	for _, i := range []*Instance{a, k, g} {
		if err := i.Stop(ctx); err != nil {
			t.Fatal(err)
		}
	}
}

// TestAdoptBlankFork: a node crash leaves a fork's child that came from a blank warm
// container and another blank container still waiting in the pool. The next backend
// adopts the child (same init, on its own root, files intact) and removes the waiting
// one with the rest.
func TestAdoptBlankFork(t *testing.T) {
	needRuntime(t)
	needBlock(t)
	dp := startDataPlane(t)
	e := newTestBackend(t, func(c *Config) { c.DataPlane, c.WarmContainers = dp, 1 })
	ctx := context.Background()
	src := e.launchBlock(t, "ab-src", testLayered(t), sandbox.Resources{})
	e.mustSh(t, src, "echo pinned > /root/state && sync -f /")
	fork := func(id string) *Instance {
		t.Helper()
		res, err := src.Fork(ctx, []sandbox.ForkSpec{{SandboxID: id}})
		if err != nil || res[0].Err != nil {
			t.Fatal(err, res[0].Err)
		}
		k := res[0].Instance.(*Instance)
		e.waitReady(t, k)
		return k
	}
	waitWarm(t, e.b, blankKey, 1)
	k := fork("ab-kid")
	if !strings.HasPrefix(k.cid, "warm.") {
		t.Fatalf("child: container %s, not a blank warm one", k.cid)
	}
	e.mustSh(t, k, "echo kid > /root/kid && sync -f /")
	waitWarm(t, e.b, blankKey, 1)
	// The crash: the pool stops where it is (its waiting container stays), and this
	// process's handles on the roots go; the data plane's stay.
	waiting := stopPoolAsCrash(t, e.b)[blankKey][0]
	pid := k.pidOf(t)
	for _, i := range []*Instance{src, k} {
		blockOf(i).Abandon()
	}

	env2, adopted := e.restart(t, "ab-kid")
	if got := adopted.pidOf(t); got != pid {
		t.Fatalf("adopted init is pid %d, was %d", got, pid)
	}
	if out := env2.mustSh(t, adopted, "cat /root/state /root/kid"); out != "pinned\nkid\n" {
		t.Fatalf("adopted child reads %q", out)
	}
	if _, err := os.Stat(filepath.Join(env2.b.rt.root, waiting)); !errors.Is(err, os.ErrNotExist) {
		t.Fatalf("blank container %s left waiting after the restart (%v)", waiting, err)
	}
	if err := adopted.Stop(ctx); err != nil {
		t.Fatal(err)
	}
	if got, _ := dp.List(ctx); len(got) != 0 {
		t.Fatalf("the data plane still serves %v after the stop", got)
	}
}

// TestCrashMidReroot: a node that dies after moving a blank warm container onto a
// sandbox's root but before recording the sandbox (its saved state still names a warm
// container) leaves nothing the restart does not remove: the container, its processes
// and cgroup, the root's mounts and loop device, the data plane's disk.
func TestCrashMidReroot(t *testing.T) {
	needRuntime(t)
	needBlock(t)
	dp := startDataPlane(t)
	e := newTestBackend(t, func(c *Config) { c.DataPlane, c.WarmContainers = dp, 1 })
	ctx := context.Background()
	fs := testLayered(t)
	src := e.launchBlock(t, "mr-src", fs, sandbox.Resources{}) // makes blank containers wanted
	waitWarm(t, e.b, blankKey, 1)
	w := e.b.warm.take(blankKey)
	if w == nil {
		t.Fatal("no blank container in the pool")
	}
	pid, err := e.b.moveBlank(ctx, w, createOpts{layers: layerRefs(fs.Layers), vsize: fs.VirtualSize})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(fmt.Sprintf("/proc/%d/root/bin/busybox", pid)); err != nil {
		t.Fatalf("blank container not on the root after the move: %v", err)
	}
	// The crash, as in TestAdoptBlankFork.
	stopPoolAsCrash(t, e.b)
	blockOf(w).Abandon()
	blockOf(src).Abandon()

	env2, adopted := e.restart(t, "mr-src")
	for deadline := time.Now().Add(10 * time.Second); unix.Kill(pid, 0) == nil; time.Sleep(10 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatalf("moved container's init %d still runs after the restart", pid)
		}
	}
	if left := blockLeftovers(t, w.l.dir); len(left) > 0 {
		t.Fatalf("moved container's root left behind:\n%s", strings.Join(left, "\n"))
	}
	for _, p := range []string{filepath.Join(env2.b.rt.root, w.cid), w.l.dir, filepath.Join(cgroupRoot, e.b.cgroupsPath(w.cid))} {
		if _, err := os.Stat(p); !errors.Is(err, os.ErrNotExist) {
			t.Errorf("%s left behind (%v)", p, err)
		}
	}
	if got, _ := dp.List(ctx); len(got) != 1 {
		t.Fatalf("the data plane serves %v, want only the adopted source's disk", got)
	}
	if err := adopted.Stop(ctx); err != nil {
		t.Fatal(err)
	}
}

// stopPoolAsCrash stops b's warm pool as a node crash would: its filler ends (one it was
// making is removed; the restart would have) and the containers waiting in it stay where
// they are, for the restart to find. It returns those, by pool key.
func stopPoolAsCrash(t *testing.T, b *Backend) map[string][]string {
	t.Helper()
	b.warm.mu.Lock()
	waiting := map[string][]string{}
	for key, q := range b.warm.ready {
		for _, w := range q {
			waiting[key] = append(waiting[key], w.cid)
		}
	}
	b.warm.ready, b.warm.wanted = map[string][]*Instance{}, nil
	b.warm.mu.Unlock()
	// Without the filler ended, it goes on making containers beside the restart, which no
	// crashed node does (and the restart's runc list trips on their state coming and going).
	if err := b.warm.close(context.Background()); err != nil {
		t.Fatal(err)
	}
	return waiting
}

// TestBlankWarmTemplate: a template's launch that finds the template's pool empty takes a
// blank warm container (and makes blank ones wanted); the sandbox is what a container of
// its own on the template would be.
func TestBlankWarmTemplate(t *testing.T) {
	needRuntime(t)
	needBlock(t)
	e := newTestBackend(t, func(c *Config) { c.WarmContainers = 1 })
	ctx := context.Background()
	fs := testLayered(t)
	cold := e.launchBlock(t, "bt-cold", fs, sandbox.Resources{})
	if cold.cid != cold.id {
		t.Fatalf("first launch came from container %s with no pool filled yet", cold.cid)
	}
	waitWarm(t, e.b, blankKey, 1)
	// The template's pool empties (a burst took it; here it is dropped), so the next
	// launch finds none of its own.
	if err := e.b.warm.forget(ctx, func(o createOpts) bool { return !o.blank }); err != nil {
		t.Fatal(err)
	}
	k := e.launchBlock(t, "bt-blank", fs, sandbox.Resources{})
	if !strings.HasPrefix(k.cid, "warm.") {
		t.Fatalf("launch with the template's pool empty: container %s, not a blank warm one", k.cid)
	}
	if want, got := e.mustSh(t, cold, mountTable), e.mustSh(t, k, mountTable); got != want {
		t.Fatalf("blank sandbox's mounts:\n%s\nwant (as runc made them):\n%s", got, want)
	}
	if out := e.mustSh(t, k, "echo x > /root/x && cat /root/x && ls /bin/busybox"); out != "x\n/bin/busybox\n" {
		t.Fatalf("blank sandbox: %q", out)
	}
	for _, i := range []*Instance{cold, k} {
		if err := i.Stop(ctx); err != nil {
			t.Fatal(err)
		}
	}
}

// usernsMade is how many user namespaces b's cache has made.
func usernsMade(b *Backend) int {
	b.usernsFDs.mu.Lock()
	defer b.usernsFDs.mu.Unlock()
	return b.usernsFDs.made
}

// waitFilled waits until b's filler has every wanted pool at its target and is making
// nothing.
func waitFilled(t *testing.T, b *Backend) {
	t.Helper()
	deadline := time.Now().Add(20 * time.Second)
	for {
		b.warm.mu.Lock()
		full := b.warm.preparing == ""
		for _, k := range b.warm.wanted {
			full = full && len(b.warm.ready[k]) >= b.warm.target(k)
		}
		b.warm.mu.Unlock()
		if full {
			return
		}
		if time.Now().After(deadline) {
			t.Fatal("warm pools not filled after 20s")
		}
		time.Sleep(10 * time.Millisecond)
	}
}
