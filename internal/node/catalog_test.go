package node

import (
	"bufio"
	"context"
	"fmt"
	"log/slog"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
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

// TestClearStranded: the catalog's lock names a process that is gone, and the open file
// that holds the lock lives on in a single-threaded child (as a fork of a killed node
// does). The handling kills that child and the lock is free; a holder that still runs is
// left alone.
func TestClearStranded(t *testing.T) {
	if _, err := exec.LookPath("flock"); err != nil {
		t.Skip("needs flock(1) (util-linux)")
	}
	path := filepath.Join(t.TempDir(), "aenv.db")
	if err := os.WriteFile(path, nil, 0o600); err != nil {
		t.Fatal(err)
	}
	// flock(1) takes the lock on fd 9 and exits (the lock names its pid); sleep inherits
	// fd 9 and keeps the lock; the shell exits.
	out, err := exec.Command("sh", "-c", `exec 9>>"$1"; flock -x 9; sleep 600 >/dev/null 2>&1 </dev/null & echo $!`, "sh", path).Output()
	if err != nil {
		t.Fatal(err)
	}
	child, err := strconv.Atoi(strings.TrimSpace(string(out)))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { syscall.Kill(child, syscall.SIGKILL) })
	holder, held := lockHolder(path)
	if !held || !gone(holder) {
		t.Fatalf("lock holder %d held=%v: want a pid that is gone", holder, held)
	}
	if got := stranded(path); !slices.Equal(got, []int{child}) {
		t.Fatalf("stranded = %v, want [%d]", got, child)
	}
	if err := clearStaleHolder(context.Background(), t.TempDir(), path, slog.New(slog.DiscardHandler)); err != nil {
		t.Fatal(err)
	}
	if _, held := lockHolder(path); held {
		t.Error("the catalog is still locked")
	}
	if syscall.Kill(child, 0) == nil {
		if st, _ := os.ReadFile(fmt.Sprintf("/proc/%d/stat", child)); statState(string(st)) != 'Z' {
			t.Error("the stranded process still runs")
		}
	}
}
