package posixfs

import (
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"syscall"
	"testing"
	"time"

	"github.com/aenv-dev/aenv/internal/repository"
	"github.com/aenv-dev/aenv/internal/repository/repositorytest"
)

// crashHelperEnv makes the test binary, re-executed, act as a writer that is
// killed with SIGKILL in the middle of its work.
const crashHelperEnv = "AENV_POSIXFS_CRASH_HELPER"

// stallReader yields n bytes, reports that it got there, then blocks.
type stallReader struct {
	n       int
	started string
}

func (s *stallReader) Read(p []byte) (int, error) {
	if s.n == 0 {
		os.WriteFile(s.started, nil, 0o644)
		select {}
	}
	k := min(len(p), s.n)
	clear(p[:k])
	s.n -= k
	return k, nil
}

func TestCrashHelper(t *testing.T) {
	dir := os.Getenv(crashHelperEnv)
	if dir == "" {
		t.Skip("helper process for TestKilledWriters")
	}
	r, err := Open(dir, Options{})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := r.lock(context.Background(), filepath.Join(dir, "records", "snapshot", "victim.lock")); err != nil {
		t.Fatal(err)
	}
	_, d := repositorytest.Blob(1, 8<<20)
	_, err = r.PutBlob(context.Background(), d, 8<<20, &stallReader{n: 1 << 20, started: filepath.Join(dir, "started")})
	t.Fatalf("PutBlob returned: %v", err)
}

// A writer killed with SIGKILL mid-blob and while holding a record lock
// leaves no partial blob, and the next writer on this host takes the lock
// over because its holder is dead, without waiting for it to go stale.
func TestKilledWriters(t *testing.T) {
	dir := t.TempDir()
	if _, err := Open(dir, Options{}); err != nil {
		t.Fatal(err)
	}
	cmd := exec.Command(os.Args[0], "-test.run=^TestCrashHelper$", "-test.count=1")
	cmd.Env = append(os.Environ(), crashHelperEnv+"="+dir)
	cmd.Stdout, cmd.Stderr = io.Discard, io.Discard
	cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	killed := false
	t.Cleanup(func() {
		if !killed {
			cmd.Process.Kill()
			cmd.Wait()
		}
	})
	deadline := time.Now().Add(20 * time.Second)
	for {
		if _, err := os.Stat(filepath.Join(dir, "started")); err == nil {
			break
		}
		if time.Now().After(deadline) {
			t.Fatal("helper never started writing")
		}
		time.Sleep(10 * time.Millisecond)
	}
	cmd.Process.Kill()
	cmd.Wait()
	killed = true

	ents, _ := os.ReadDir(filepath.Join(dir, "tmp"))
	if len(ents) == 0 {
		t.Fatal("the killed writer left no temp file: the test did not interrupt a write")
	}
	// Neither locks nor temp files go stale by age here: only the dead-writer
	// rules can free the lock and remove the partial upload.
	r, err := Open(dir, Options{StaleTmpAge: time.Hour, StaleLockAge: time.Hour, LockTimeout: 3 * time.Second})
	if err != nil {
		t.Fatal(err)
	}
	_, d := repositorytest.Blob(1, 8<<20)
	if _, err := r.StatBlob(context.Background(), d); !errors.Is(err, repository.ErrNotFound) {
		t.Fatalf("partial blob visible: %v", err)
	}
	if ents, _ := os.ReadDir(filepath.Join(dir, "tmp")); len(ents) != 0 {
		t.Fatalf("crash leftovers not cleaned: %v", ents)
	}
	if _, err := r.PutRecord(context.Background(), repositorytest.Record(repository.KindSnapshot, "victim")); err != nil {
		t.Fatalf("record locked by a dead writer: %v", err)
	}
}

// Only temp files of dead writers on this host are removed at once: another
// host's, a live process's and unparsable names wait for StaleTmpAge.
func TestDeadWritersTmp(t *testing.T) {
	r, err := Open(t.TempDir(), Options{})
	if err != nil {
		t.Fatal(err)
	}
	dead := exec.Command("true")
	if err := dead.Run(); err != nil {
		t.Fatal(err)
	}
	deadPID := dead.Process.Pid
	for _, tc := range []struct {
		name string
		want bool
	}{
		{fmt.Sprintf("blob-%s.%d-123", r.hostTag(), deadPID), true},
		{fmt.Sprintf("rec-%s.%d-123", r.hostTag(), deadPID), true},
		{fmt.Sprintf("blob-%s.%d-123", r.hostTag(), 1), false},
		{fmt.Sprintf("blob-%s.%d-123", r.hostTag(), os.Getpid()), false},
		{fmt.Sprintf("blob-0000beef.%d-123", deadPID), r.hostTag() == "0000beef"},
		{"blob-123456", false},
		{"gc-abc", false},
	} {
		if got := r.deadWritersTmp(tc.name); got != tc.want {
			t.Errorf("deadWritersTmp(%q) = %v, want %v", tc.name, got, tc.want)
		}
	}
}
