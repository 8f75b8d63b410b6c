package oci

import (
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/aenv-dev/aenv/internal/sandbox"
	"golang.org/x/sys/unix"
)

// killCgroupSeq numbers the cgroups TestKillInit makes.
var killCgroupSeq int

// startInCgroup starts `sleep` in a fresh cgroup (in every hierarchy that takes it) and
// returns the process, its pid file and the cgroup's path relative to the hierarchies.
func startInCgroup(t *testing.T, v2 bool) (*exec.Cmd, string, string) {
	t.Helper()
	killCgroupSeq++
	rel := fmt.Sprintf("/%s/kill-%d-%d", testCgroup, os.Getpid(), killCgroupSeq)
	cmd := exec.Command("sleep", "60")
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		_ = cmd.Process.Kill()
		_ = cmd.Wait()
		for _, d := range cgroupDirs(rel, v2) {
			thaw(d)
			os.Remove(d)
		}
	})
	joined := 0
	for _, d := range cgroupDirs(rel, v2) {
		if err := os.MkdirAll(d, 0o755); err != nil {
			continue
		}
		// cpuset and a few others refuse tasks until configured: any hierarchy will do.
		if os.WriteFile(filepath.Join(d, "cgroup.procs"), []byte(strconv.Itoa(cmd.Process.Pid)), 0o644) == nil {
			joined++
		}
	}
	if joined == 0 {
		t.Skip("cannot move a process into a test cgroup")
	}
	pidFile := filepath.Join(t.TempDir(), "init.pid")
	if err := os.WriteFile(pidFile, []byte(strconv.Itoa(cmd.Process.Pid)), 0o600); err != nil {
		t.Fatal(err)
	}
	return cmd, pidFile, rel
}

// freeze freezes the cgroup rel where a freezer is available; false when none is.
func freeze(rel string, v2 bool) bool {
	frozen := false
	for _, d := range cgroupDirs(rel, v2) {
		if os.WriteFile(filepath.Join(d, "freezer.state"), []byte("FROZEN"), 0o644) == nil ||
			os.WriteFile(filepath.Join(d, "cgroup.freeze"), []byte("1"), 0o644) == nil {
			frozen = true
		}
	}
	return frozen
}

// waitExit reports how cmd ended within 5 s: nil when it did not.
func waitExit(cmd *exec.Cmd) *os.ProcessState {
	done := make(chan struct{})
	go func() { _ = cmd.Wait(); close(done) }()
	select {
	case <-done:
		return cmd.ProcessState
	case <-time.After(5 * time.Second):
		return nil
	}
}

func TestKillInit(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("needs root (cgroups)")
	}
	v2 := unifiedOnly()
	t.Run("running", func(t *testing.T) {
		cmd, pidFile, rel := startInCgroup(t, v2)
		if err := killInit(pidFile, rel, v2, nil); err != nil {
			t.Fatal(err)
		}
		st := waitExit(cmd)
		if st == nil || st.Sys().(syscall.WaitStatus).Signal() != syscall.SIGKILL {
			t.Fatalf("process after killInit: %v", st)
		}
	})
	t.Run("frozen", func(t *testing.T) {
		cmd, pidFile, rel := startInCgroup(t, v2)
		if !freeze(rel, v2) {
			t.Skip("no freezer")
		}
		if err := killInit(pidFile, rel, v2, nil); err != nil {
			t.Fatal(err)
		}
		if st := waitExit(cmd); st == nil {
			t.Fatal("frozen process survived killInit")
		}
	})
	t.Run("pid of another cgroup is left alone", func(t *testing.T) {
		cmd, pidFile, _ := startInCgroup(t, v2)
		other := fmt.Sprintf("/%s/kill-other-%d", testCgroup, os.Getpid())
		if err := killInit(pidFile, other, v2, nil); !errors.Is(err, errNoInit) {
			t.Fatalf("killInit of a pid outside the cgroup = %v, want errNoInit", err)
		}
		if err := unix.Kill(cmd.Process.Pid, 0); err != nil {
			t.Fatalf("process outside the cgroup was signalled: %v", err)
		}
	})
	t.Run("exited", func(t *testing.T) {
		cmd, pidFile, rel := startInCgroup(t, v2)
		_ = cmd.Process.Kill()
		_ = cmd.Wait()
		if err := killInit(pidFile, rel, v2, nil); !errors.Is(err, errNoInit) {
			t.Fatalf("killInit of a reaped process = %v, want errNoInit", err)
		}
	})
	t.Run("no pid file", func(t *testing.T) {
		if err := killInit(filepath.Join(t.TempDir(), "none"), "/x", v2, nil); !errors.Is(err, errNoInit) {
			t.Fatalf("killInit without a pid file = %v, want errNoInit", err)
		}
	})
	t.Run("garbage pid file", func(t *testing.T) {
		for _, content := range []string{"", "abc", "1", "-5"} {
			p := filepath.Join(t.TempDir(), "pid")
			os.WriteFile(p, []byte(content), 0o600)
			if err := killInit(p, "/x", v2, nil); err == nil || errors.Is(err, errNoInit) {
				t.Errorf("killInit with pid file %q = %v, want a parse error", content, err)
			}
		}
	})
}

// TestUsernsCache checks get and put: a get makes a namespace with the mapping asked for
// unless one was put back for it, which it then takes; the cache owns what was put and
// closes it with itself.
func TestUsernsCache(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("needs root (user namespaces with arbitrary mappings)")
	}
	c := newUsernsCache()
	a := idMap{HostID: 300000, Size: idRangeSize}
	b := idMap{HostID: 300000 + idRangeSize, Size: idRangeSize}
	fa, err := c.get(a)
	if err != nil {
		t.Fatal(err)
	}
	// The namespace has the mapping asked for.
	pid, pidfd := inUserns(t, fa)
	if !mapsAre(pid, a) || mapsAre(pid, b) {
		t.Fatalf("namespace for %+v: uid_map of a process in it does not match", a)
	}
	unix.Close(pidfd)
	fa2, err := c.get(a)
	if err != nil || fa2 == fa || c.made != 2 {
		t.Fatalf("second get of one mapping with nothing put back = %d, %v after %d made; want a new fd (not %d), a second made", fa2, err, c.made, fa)
	}
	unix.Close(fa2)
	c.put(a, fa)
	if got, err := c.get(a); err != nil || got != fa || c.made != 2 {
		t.Fatalf("get after a put = %d, %v after %d made; want the fd put, %d, none made", got, err, c.made, fa)
	}
	c.put(a, fa)
	fb, err := c.get(b)
	if err != nil || fb == fa {
		t.Fatalf("get of another mapping = %d, %v; want a new fd", fb, err)
	}
	unix.Close(fb)
	if err := c.close(); err != nil {
		t.Fatal(err)
	}
	var st unix.Stat_t
	if err := unix.Fstat(fa, &st); !errors.Is(err, unix.EBADF) {
		t.Fatalf("fd put back still open after close: %v", err)
	}
	if _, err := c.get(a); err == nil {
		t.Fatal("get after close succeeded")
	}
}

// inUserns starts a process in the user namespace fd and returns its pid and pidfd.
func inUserns(t *testing.T, fd int) (pid, pidfd int) {
	t.Helper()
	// nsenter joins the namespace (a Go child cannot setns into a user namespace
	// before exec), then sleep holds it while the test reads the maps.
	dup, err := unix.FcntlInt(uintptr(fd), unix.F_DUPFD_CLOEXEC, 0)
	if err != nil {
		t.Fatal(err)
	}
	f := os.NewFile(uintptr(dup), "userns") // the child's fd 3
	defer f.Close()
	cmd := exec.Command("nsenter", "--user=/proc/self/fd/3", "sleep", "30")
	cmd.ExtraFiles = []*os.File{f}
	if err := cmd.Start(); err != nil {
		t.Skipf("nsenter: %v", err)
	}
	t.Cleanup(func() { _ = cmd.Process.Kill(); _ = cmd.Wait() })
	pidfd, err = unix.PidfdOpen(cmd.Process.Pid, 0)
	if err != nil {
		t.Fatal(err)
	}
	// Wait for the exec of sleep: the maps are those of nsenter's namespace until then.
	for range 500 {
		if b, _ := os.ReadFile(fmt.Sprintf("/proc/%d/comm", cmd.Process.Pid)); strings.TrimSpace(string(b)) == "sleep" {
			return cmd.Process.Pid, pidfd
		}
		time.Sleep(2 * time.Millisecond)
	}
	t.Fatal("nsenter did not exec sleep")
	return 0, 0
}

func TestSealedCopy(t *testing.T) {
	bin, err := exec.LookPath("true")
	if err != nil {
		t.Skip("no true(1)")
	}
	f, err := sealedCopy("true", bin)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	seals, err := unix.FcntlInt(f.Fd(), unix.F_GET_SEALS, 0)
	if err != nil || seals != runcMemfdSeals {
		t.Fatalf("seals = %#x, %v; want %#x", seals, err, runcMemfdSeals)
	}
	want, _ := os.ReadFile(bin)
	got, err := os.ReadFile(fmt.Sprintf("/proc/self/fd/%d", f.Fd()))
	if err != nil || string(got) != string(want) {
		t.Fatalf("copy differs from %s (%d vs %d bytes): %v", bin, len(got), len(want), err)
	}
	if _, err := f.Write([]byte("x")); err == nil {
		t.Fatal("write to the sealed copy succeeded")
	}
	// It runs through /proc/self/fd, as the runtime is run.
	if err := exec.Command(fmt.Sprintf("/proc/self/fd/%d", f.Fd())).Run(); err != nil {
		t.Fatalf("run the sealed copy: %v", err)
	}
	if _, err := sealedCopy("missing", filepath.Join(t.TempDir(), "missing")); err == nil {
		t.Fatal("sealed copy of a missing file succeeded")
	}
}

// TestStopAfterCapture: a pause to disk's stop kills the sandbox before it returns and
// tears the rest down in the background; a relaunch under the same id meanwhile works
// (on a container id of its own) and sees the captured files; afterwards nothing of the
// old container is left.
func TestStopAfterCapture(t *testing.T) {
	e := newTestBackend(t, nil)
	fs := testLayered(t)
	ctx := context.Background()
	a := e.launchBlock(t, "sac-a", fs, sandbox.Resources{CPUCount: 1, MemoryMB: 128})
	e.mustSh(t, a, "echo kept > /root/f")
	c, err := a.Snapshot(ctx)
	if err != nil {
		t.Fatal(err)
	}
	raw, err := os.ReadFile(a.l.pid())
	if err != nil {
		t.Fatal(err)
	}
	pid, _ := strconv.Atoi(string(raw))
	oldCid, oldSlot := a.cid, traceSlot(t, a.slot)
	if err := a.StopAfterCapture(ctx); err != nil {
		t.Fatal(err)
	}
	if err := unix.Kill(pid, 0); !errors.Is(err, unix.ESRCH) {
		// The runtime's init may linger as a zombie only while unreaped by its parent.
		if st, _ := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid)); !zombie(string(st)) {
			t.Fatalf("init %d alive after StopAfterCapture: %v", pid, err)
		}
	}
	if err := a.StopAfterCapture(ctx); err != nil {
		t.Fatalf("second StopAfterCapture: %v", err)
	}
	r := e.launchPlan(t, sandbox.LaunchPlan{Kind: sandbox.LaunchResume, SandboxID: "sac-a",
		Paused: pausedState{ID: "sac-a", Disk: c.(*Captured)}, Resources: sandbox.Resources{CPUCount: 1, MemoryMB: 128}})
	if out := e.mustSh(t, r, "cat /root/f"); out != "kept\n" {
		t.Fatalf("after relaunch: %q", out)
	}
	wctx, cancel := context.WithTimeout(ctx, time.Minute)
	defer cancel()
	if err := e.b.waitTeardowns(wctx); err != nil {
		t.Fatal(err)
	}
	if r.cid == oldCid {
		// The teardown was quick enough to free the id first: fine, but then the old
		// container's leftovers cannot be told apart from the new one's.
		t.Logf("relaunch reused container id %s", oldCid)
	} else {
		assertGone(t, e.b, oldCid, oldSlot)
	}
	e.b.mu.Lock()
	n := len(e.b.tearing)
	e.b.mu.Unlock()
	if n != 0 {
		t.Fatalf("teardowns still counted: %d", n)
	}
	if err := r.Stop(ctx); err != nil {
		t.Fatal(err)
	}
	assertGone(t, e.b, r.cid, nil)
}

// zombie reports whether a /proc/PID/stat line is a zombie's.
func zombie(stat string) bool {
	i := len(stat) - 1
	for i >= 0 && stat[i] != ')' {
		i--
	}
	return i >= 0 && i+2 < len(stat) && stat[i+2] == 'Z'
}
