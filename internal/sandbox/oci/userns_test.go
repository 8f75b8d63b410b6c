package oci

import (
	"context"
	"fmt"
	"os"
	"os/exec"
	"syscall"
	"testing"

	"golang.org/x/sys/unix"

	"github.com/aenv-dev/aenv/internal/sandbox"
)

// nsInode is the inode of the namespace file fd or path names.
func nsInode(t *testing.T, fd int) uint64 {
	t.Helper()
	var st unix.Stat_t
	if err := unix.Fstat(fd, &st); err != nil {
		t.Fatal(err)
	}
	return st.Ino
}

// TestUsernsKeptFromInit checks the cache's round: a stopped sandbox's own user namespace
// is kept for its mapping, and the next create with that mapping takes it instead of
// forking; a running sandbox leaves no namespace descriptor in the node.
func TestUsernsKeptFromInit(t *testing.T) {
	e := newTestBackend(t, func(c *Config) { c.UserNamespace = UserNSOn })
	c := e.b.usernsFDs
	i := e.launch(t, "uk1", sandbox.Resources{})
	m := *i.idmap
	c.mu.Lock()
	_, held := c.fds[m]
	made := c.made
	c.mu.Unlock()
	if held {
		t.Fatal("the cache holds the namespace of a running sandbox")
	}
	raw, err := os.ReadFile(i.l.pid())
	if err != nil {
		t.Fatal(err)
	}
	var pid int
	fmt.Sscan(string(raw), &pid)
	var st unix.Stat_t
	if err := unix.Stat(fmt.Sprintf("/proc/%d/ns/user", pid), &st); err != nil {
		t.Fatal(err)
	}
	if err := i.Stop(context.Background()); err != nil {
		t.Fatal(err)
	}
	c.mu.Lock()
	fd, held := c.fds[m]
	c.mu.Unlock()
	if !held {
		t.Fatal("the stopped sandbox's user namespace was not kept")
	}
	if got := nsInode(t, fd); got != st.Ino {
		t.Fatalf("kept namespace %d, the init's was %d", got, st.Ino)
	}
	got, err := c.get(m)
	if err != nil {
		t.Fatal(err)
	}
	defer unix.Close(got)
	c.mu.Lock()
	_, held = c.fds[m]
	madeAfter := c.made
	c.mu.Unlock()
	if held || madeAfter != made || got != fd {
		t.Fatalf("get after the stop: fd %d (kept %d), still held %v, forks %d → %d", got, fd, held, made, madeAfter)
	}
}

// TestUsernsKeeperChecksMapping checks that only a live process's namespace with exactly
// the slot's mapping is kept: a sandbox's processes can make nested namespaces with
// mappings of their own, which the next sandbox on the slot must never get.
func TestUsernsKeeperChecksMapping(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("needs root (user namespaces with arbitrary mappings)")
	}
	want := idMap{HostID: 3_000_000_000, Size: 65536}
	start := func(t *testing.T, m idMap) (pid, pidfd int) {
		t.Helper()
		cmd := exec.Command("sleep", "60")
		cmd.SysProcAttr = &syscall.SysProcAttr{
			Cloneflags:  syscall.CLONE_NEWUSER,
			UidMappings: []syscall.SysProcIDMap{{ContainerID: 0, HostID: int(m.HostID), Size: int(m.Size)}},
			GidMappings: []syscall.SysProcIDMap{{ContainerID: 0, HostID: int(m.HostID), Size: int(m.Size)}},
		}
		if err := cmd.Start(); err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { _ = cmd.Process.Kill(); _ = cmd.Wait() })
		fd, err := unix.PidfdOpen(cmd.Process.Pid, 0)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { unix.Close(fd) })
		return cmd.Process.Pid, fd
	}
	for _, tc := range []struct {
		name string
		m    idMap
		keep bool
	}{
		{"same mapping", want, true},
		{"shifted", idMap{HostID: want.HostID + 1, Size: want.Size - 1}, false},
		{"smaller", idMap{HostID: want.HostID, Size: 1000}, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			c := newUsernsCache()
			defer c.close()
			pid, pidfd := start(t, tc.m)
			c.keeper(&want)(pid, pidfd)
			c.mu.Lock()
			_, kept := c.fds[want]
			c.mu.Unlock()
			if kept != tc.keep {
				t.Fatalf("kept %v, want %v", kept, tc.keep)
			}
		})
	}
	t.Run("exited", func(t *testing.T) {
		c := newUsernsCache()
		defer c.close()
		pid, pidfd := start(t, want)
		if err := unix.PidfdSendSignal(pidfd, unix.SIGKILL, nil, 0); err != nil {
			t.Fatal(err)
		}
		if _, err := unix.Poll([]unix.PollFd{{Fd: int32(pidfd), Events: unix.POLLIN}}, 5000); err != nil {
			t.Fatal(err)
		}
		c.keeper(&want)(pid, pidfd)
		if len(c.fds) != 0 {
			t.Fatal("the namespace of an exited process was kept")
		}
	})
	if newUsernsCache().keeper(nil) != nil {
		t.Error("a sandbox without a user namespace got a keeper")
	}
}

// BenchmarkUsernsFD makes user namespaces from a process holding a large heap, as the node
// does in a fill, and writes the heap once after each, as the node's allocations and GC
// do: cpu-ms/op is this process's CPU and its children's per namespace, the copy-on-write
// faults a fork leaves behind included.
func BenchmarkUsernsFD(b *testing.B) {
	if os.Geteuid() != 0 {
		b.Skip("needs root (user namespaces with arbitrary mappings)")
	}
	heap := make([]byte, benchHeapMiB<<20)
	touch := func() {
		for i := 0; i < len(heap); i += 4096 {
			heap[i]++
		}
	}
	touch()
	m := idMap{HostID: 300000, Size: idRangeSize}
	var before, after unix.Rusage
	cpu := func(r *unix.Rusage) int64 { return r.Utime.Nano() + r.Stime.Nano() }
	children := func() int64 {
		var c unix.Rusage
		_ = unix.Getrusage(unix.RUSAGE_CHILDREN, &c)
		return cpu(&c)
	}
	c0 := children()
	_ = unix.Getrusage(unix.RUSAGE_SELF, &before)
	b.ResetTimer()
	for range b.N {
		fd, err := usernsFD(m)
		if err != nil {
			b.Fatal(err)
		}
		unix.Close(fd)
		touch()
	}
	b.StopTimer()
	_ = unix.Getrusage(unix.RUSAGE_SELF, &after)
	total := cpu(&after) - cpu(&before) + children() - c0
	b.ReportMetric(float64(total)/float64(b.N)/1e6, "cpu-ms/op")
}

// benchHeapMiB is the heap BenchmarkUsernsFD holds: a node with ~1 000 sandboxes has a
// few hundred MiB.
const benchHeapMiB = 256
