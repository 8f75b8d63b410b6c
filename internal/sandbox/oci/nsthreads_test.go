package oci

import (
	"fmt"
	"log/slog"
	"os"
	"os/exec"
	"path/filepath"
	"sync"
	"testing"

	"golang.org/x/sys/unix"
)

// mountNSHolder starts a process in a mount namespace of its own (private propagation)
// and returns its pid.
func mountNSHolder(t *testing.T) int {
	t.Helper()
	if os.Geteuid() != 0 {
		t.Skip("needs root (setns into a mount namespace)")
	}
	if _, err := exec.LookPath("unshare"); err != nil {
		t.Skip("needs unshare(1)")
	}
	cmd := exec.Command("unshare", "--mount", "--propagation", "private", "sleep", "60")
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { cmd.Process.Kill(); cmd.Wait() })
	self := nsIno(t, "/proc/self/ns/mnt")
	for i := 0; i < 500; i++ {
		if nsIno(t, fmt.Sprintf("/proc/%d/ns/mnt", cmd.Process.Pid)) != self {
			return cmd.Process.Pid
		}
		unix.Nanosleep(&unix.Timespec{Nsec: 10e6}, nil)
	}
	t.Fatal("unshare did not enter a mount namespace of its own")
	return 0
}

func nsIno(t *testing.T, path string) uint64 {
	t.Helper()
	var st unix.Stat_t
	if err := unix.Stat(path, &st); err != nil {
		t.Fatal(err)
	}
	return st.Ino
}

// threadState is what a job sees of its thread.
type threadState struct {
	tid      int
	ns       uint64 // its mount namespace
	root     uint64 // the inode of its root directory
	cwd      string
	mountsOK bool // a tmpfs mounted in the other namespace is not seen from here
}

func stateOf(mark string) (threadState, error) {
	var s threadState
	s.tid = unix.Gettid()
	var st unix.Stat_t
	if err := unix.Stat("/proc/thread-self/ns/mnt", &st); err != nil {
		return s, err
	}
	s.ns = st.Ino
	if err := unix.Stat("/", &st); err != nil {
		return s, err
	}
	s.root = st.Ino
	cwd, err := os.Getwd()
	if err != nil {
		return s, err
	}
	s.cwd = cwd
	_, err = os.Stat(filepath.Join(mark, "inside"))
	s.mountsOK = os.IsNotExist(err)
	return s, nil
}

func TestNSThreads(t *testing.T) {
	pid := mountNSHolder(t)
	nt, err := newNSThreads(slog.Default())
	if err != nil {
		t.Fatal(err)
	}
	defer nt.close()
	mark := t.TempDir()
	host, err := stateOf(mark)
	if err != nil {
		t.Fatal(err)
	}
	other := nsIno(t, fmt.Sprintf("/proc/%d/ns/mnt", pid))

	// A job joins the other namespace and mounts there; the next job on the same thread
	// is back in the node's namespace, root and working directory and sees no such mount.
	var inside threadState
	if err := nt.run(func() error {
		if err := joinMountNS(pid); err != nil {
			return err
		}
		if err := unix.Mount("tmpfs", mark, "tmpfs", 0, ""); err != nil {
			return err
		}
		if err := os.WriteFile(filepath.Join(mark, "inside"), nil, 0o600); err != nil {
			return err
		}
		inside, err = stateOf(mark)
		return err
	}); err != nil {
		t.Fatal(err)
	}
	if inside.ns != other {
		t.Fatalf("the job ran in mount namespace %d, want the holder's %d", inside.ns, other)
	}
	tids := map[int]bool{}
	for i := 0; i < 10; i++ {
		var back threadState
		if err := nt.run(func() (err error) { back, err = stateOf(mark); return err }); err != nil {
			t.Fatal(err)
		}
		if back.ns != host.ns || back.root != host.root || back.cwd != host.cwd || !back.mountsOK {
			t.Fatalf("after a job in another namespace the thread is at %+v, want the node's %+v", back, host)
		}
		tids[back.tid] = true
	}
	if len(tids) != 1 || !tids[inside.tid] {
		t.Fatalf("sequential jobs ran on threads %v, want the first job's %d every time", tids, inside.tid)
	}

	// Concurrent jobs: never more threads than nsThreadsMax.
	var mu sync.Mutex
	var wg sync.WaitGroup
	for i := 0; i < 32; i++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			if err := nt.run(func() error {
				if err := joinMountNS(pid); err != nil {
					return err
				}
				mu.Lock()
				tids[unix.Gettid()] = true
				mu.Unlock()
				return nil
			}); err != nil {
				t.Error(err)
			}
		}()
	}
	wg.Wait()
	if len(tids) > nsThreadsMax {
		t.Fatalf("32 concurrent jobs ran on %d threads, want at most %d", len(tids), nsThreadsMax)
	}

	// A thread that cannot come back (it lost CAP_SYS_ADMIN) is thrown away; the next job
	// gets a fresh one.
	var dropped int
	if err := nt.run(func() error {
		dropped = unix.Gettid()
		return dropSysAdmin()
	}); err != nil {
		t.Fatal(err)
	}
	for i := 0; i < 2*nsThreadsMax; i++ {
		var s threadState
		if err := nt.run(func() (err error) { s, err = stateOf(mark); return err }); err != nil {
			t.Fatal(err)
		}
		if s.tid == dropped {
			t.Fatalf("a job ran on thread %d, which could not come back to the node's namespace", dropped)
		}
		if s.ns != host.ns {
			t.Fatalf("a job ran in namespace %d, want the node's %d", s.ns, host.ns)
		}
	}

	nt.close()
	if err := nt.run(func() error { return nil }); err != errNSThreadsClosed {
		t.Fatalf("run after close: %v, want %v", err, errNSThreadsClosed)
	}
}

// dropSysAdmin takes CAP_SYS_ADMIN out of the calling thread's effective set.
func dropSysAdmin() error {
	hdr := unix.CapUserHeader{Version: unix.LINUX_CAPABILITY_VERSION_3}
	var data [2]unix.CapUserData
	if err := unix.Capget(&hdr, &data[0]); err != nil {
		return err
	}
	data[unix.CAP_SYS_ADMIN/32].Effective &^= 1 << (unix.CAP_SYS_ADMIN % 32)
	return unix.Capset(&hdr, &data[0])
}
