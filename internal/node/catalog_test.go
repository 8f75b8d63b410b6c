package node

import (
	"bufio"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"
)

func TestFindLockHolder(t *testing.T) {
	locks := "1: FLOCK  ADVISORY  WRITE 4242 fd:01:1234 0 EOF\n" +
		"1: -> FLOCK  ADVISORY  WRITE 5151 fd:01:1234 0 EOF\n" +
		"2: POSIX  ADVISORY  WRITE 77 fd:01:999 0 EOF\n" +
		"3: FLOCK  ADVISORY  WRITE 88 103:02:1234 0 EOF\n"
	tests := []struct {
		name     string
		dev, ino uint64
		pid      int
		ok       bool
	}{
		{"holder, not the waiter", 0xfd01, 1234, 4242, true},
		{"posix locks are not bbolt's", 0xfd01, 999, 0, false},
		{"same inode on another device", 0x10302, 1234, 88, true},
		{"no lock", 0xfd01, 5, 0, false},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			pid, ok := findLockHolder(bufio.NewScanner(strings.NewReader(locks)), tt.dev, tt.ino)
			if pid != tt.pid || ok != tt.ok {
				t.Errorf("= %d %v, want %d %v", pid, ok, tt.pid, tt.ok)
			}
		})
	}
}

// TestLockHolderLive finds this process as the holder of a real flock, and sees that
// it is not dying.
func TestLockHolderLive(t *testing.T) {
	path := filepath.Join(t.TempDir(), "db")
	f, err := os.Create(path)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	if err := syscall.Flock(int(f.Fd()), syscall.LOCK_EX|syscall.LOCK_NB); err != nil {
		t.Fatal(err)
	}
	pid, ok := lockHolder(path)
	if !ok || pid != os.Getpid() {
		t.Fatalf("lockHolder = %d %v, want %d", pid, ok, os.Getpid())
	}
	if dying(pid) {
		t.Error("a live process reported as dying")
	}
}

// TestDyingZombie: a process whose main thread has exited (here: an unreaped child)
// reads as dying.
func TestDyingZombie(t *testing.T) {
	cmd := exec.Command("/bin/true")
	if err := cmd.Start(); err != nil {
		t.Skipf("cannot start /bin/true: %v", err)
	}
	defer cmd.Wait()
	deadline := time.Now().Add(5 * time.Second)
	for !dying(cmd.Process.Pid) {
		if time.Now().After(deadline) {
			t.Fatal("an exited, unreaped child never read as dying")
		}
		time.Sleep(5 * time.Millisecond)
	}
}

func TestStatState(t *testing.T) {
	for in, want := range map[string]byte{
		"12 (aenv) S 1 2":      'S',
		"12 (a) b) (c)) Z 1 2": 'Z',
		"12 (aenv)":            0,
		"garbage":              0,
	} {
		if got := statState(in); got != want {
			t.Errorf("statState(%q) = %q, want %q", in, got, want)
		}
	}
}
