package oci

import (
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"golang.org/x/sys/unix"
)

// fakeCreated makes a runc-like state directory whose "init" is a real process running
// script (with $FIFO set to the exec fifo), and returns the directory.
func fakeCreated(t *testing.T, script string) string {
	t.Helper()
	dir := t.TempDir()
	fifo := filepath.Join(dir, "exec.fifo")
	if err := unix.Mkfifo(fifo, 0o600); err != nil {
		t.Fatal(err)
	}
	cmd := exec.Command("sh", "-c", script)
	cmd.Env = append(os.Environ(), "FIFO="+fifo)
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	done := make(chan struct{})
	go func() { _ = cmd.Wait(); close(done) }()
	t.Cleanup(func() { _ = cmd.Process.Kill(); <-done })
	raw, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", cmd.Process.Pid))
	if err != nil {
		t.Fatal(err)
	}
	s := string(raw)
	start := strings.Fields(s[strings.LastIndexByte(s, ')')+1:])[19]
	state := fmt.Sprintf(`{"id":"c","init_process_pid":%d,"init_process_start":%s}`, cmd.Process.Pid, start)
	if err := os.WriteFile(filepath.Join(dir, "state.json"), []byte(state), 0o600); err != nil {
		t.Fatal(err)
	}
	return dir
}

func TestStartRunc(t *testing.T) {
	tests := []struct {
		name    string
		script  string // the init; "" for no state dir content at all
		timeout time.Duration
		wantErr error // nil: started
		fifo    bool  // the fifo is still there afterwards
	}{
		// The init blocks opening the fifo, writes its byte, then "execs" (closes it).
		{name: "started", script: `printf 0 > "$FIFO"; exec sleep 5`, timeout: 5 * time.Second},
		// The init opens the fifo late: the reader waits for it.
		{name: "slow init", script: `sleep 0.3; printf 0 > "$FIFO"; exec sleep 5`, timeout: 5 * time.Second},
		// The init dies before opening the fifo: no byte will ever come.
		{name: "init dies", script: `sleep 0.2; exit 0`, timeout: 5 * time.Second, wantErr: errInitGone, fifo: true},
		// The init opens its end and dies without writing.
		{name: "no byte", script: `exec 3> "$FIFO"; exit 0`, timeout: 5 * time.Second, wantErr: errInitGone, fifo: true},
		// The state directory's fifo is removed (a reconcile removing the container)
		// while the reader waits, and the init dies: the reader is still released.
		{name: "fifo removed", script: `sleep 0.5; rm "$FIFO"; exit 0`, timeout: 5 * time.Second, wantErr: errInitGone},
		// The init never opens the fifo: the caller's deadline ends the wait.
		{name: "deadline", script: `exec sleep 5`, timeout: 300 * time.Millisecond, wantErr: context.DeadlineExceeded, fifo: true},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			dir := fakeCreated(t, tc.script)
			ctx, cancel := context.WithTimeout(context.Background(), tc.timeout)
			defer cancel()
			err := startRunc(ctx, dir, "/proc")
			if tc.wantErr == nil && err != nil || tc.wantErr != nil && !errors.Is(err, tc.wantErr) {
				t.Fatalf("startRunc = %v, want %v", err, tc.wantErr)
			}
			_, serr := os.Lstat(filepath.Join(dir, "exec.fifo"))
			if got := serr == nil; got != tc.fifo {
				t.Fatalf("fifo left = %v, want %v", got, tc.fifo)
			}
		})
	}
}

func TestStartRuncNotCreated(t *testing.T) {
	dir := fakeCreated(t, `exec sleep 5`)
	if err := os.Remove(filepath.Join(dir, "exec.fifo")); err != nil {
		t.Fatal(err)
	}
	if err := startRunc(context.Background(), dir, "/proc"); err == nil || !strings.Contains(err.Error(), "not a created container") {
		t.Fatalf("startRunc of a started container = %v, want not a created container", err)
	}
	if err := startRunc(context.Background(), t.TempDir(), "/proc"); err == nil {
		t.Fatal("startRunc without a state file succeeded")
	}
}

func TestStartCrun(t *testing.T) {
	tests := []struct {
		name    string
		fifo    bool // the state directory has its exec fifo
		reader  bool // an init holds the fifo's read end, as crun's does
		wantErr error
		wantMsg string
		left    bool // the fifo is still there afterwards
	}{
		{name: "started", fifo: true, reader: true},
		{name: "init gone", fifo: true, wantErr: errInitGone, left: true},
		{name: "not created", wantMsg: "not a created container"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			dir := t.TempDir()
			fifo := filepath.Join(dir, "exec.fifo")
			rfd := -1
			if tc.fifo {
				if err := unix.Mkfifo(fifo, 0o600); err != nil {
					t.Fatal(err)
				}
			}
			if tc.reader {
				fd, err := unix.Open(fifo, unix.O_RDONLY|unix.O_NONBLOCK|unix.O_CLOEXEC, 0)
				if err != nil {
					t.Fatal(err)
				}
				rfd = fd
				defer unix.Close(fd)
			}
			err := startCrun(dir)
			switch {
			case tc.wantErr != nil && !errors.Is(err, tc.wantErr),
				tc.wantMsg != "" && (err == nil || !strings.Contains(err.Error(), tc.wantMsg)),
				tc.wantErr == nil && tc.wantMsg == "" && err != nil:
				t.Fatalf("startCrun = %v, want %v%s", err, tc.wantErr, tc.wantMsg)
			}
			_, serr := os.Lstat(fifo)
			if got := serr == nil; got != tc.left {
				t.Fatalf("fifo left = %v, want %v", got, tc.left)
			}
			if rfd >= 0 {
				buf := make([]byte, 2)
				if n, err := unix.Read(rfd, buf); n != 1 || err != nil || buf[0] != 0 {
					t.Fatalf("the init read %d bytes %v (%v), want the one byte 0", n, buf[:max(n, 0)], err)
				}
			}
		})
	}
}
