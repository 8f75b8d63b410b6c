package oci

import (
	"bytes"
	"context"
	"errors"
	"os"
	"os/exec"
	"testing"
	"time"

	"golang.org/x/sys/unix"
)

func TestRunPolled(t *testing.T) {
	tests := []struct {
		name     string
		args     []string
		timeout  time.Duration
		wantCode int // -1: killed by a signal
		wantOut  string
	}{
		{name: "exit 0", args: []string{"sh", "-c", "sleep 0.05; echo done"}, wantOut: "done\n"},
		{name: "exit 3", args: []string{"sh", "-c", "exit 3"}, wantCode: 3},
		{name: "exits at once", args: []string{"true"}},
		{name: "context ends it", args: []string{"sleep", "10"}, timeout: 100 * time.Millisecond, wantCode: -1},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			ctx := context.Background()
			if tt.timeout > 0 {
				var cancel context.CancelFunc
				ctx, cancel = context.WithTimeout(ctx, tt.timeout)
				defer cancel()
			}
			cmd := exec.CommandContext(ctx, tt.args[0], tt.args[1:]...)
			var out bytes.Buffer
			cmd.Stdout = &out
			start := time.Now()
			err := runPolled(cmd)
			if tt.wantCode == 0 {
				if err != nil {
					t.Fatalf("runPolled: %v", err)
				}
			} else {
				var ee *exec.ExitError
				if !errors.As(err, &ee) {
					t.Fatalf("runPolled: %v, want an exit error", err)
				}
				if got := ee.ExitCode(); got != tt.wantCode {
					t.Fatalf("exit code %d, want %d", got, tt.wantCode)
				}
			}
			if out.String() != tt.wantOut {
				t.Fatalf("output %q, want %q", out.String(), tt.wantOut)
			}
			if !cmd.ProcessState.Exited() && tt.wantCode != -1 {
				t.Fatalf("process state %v", cmd.ProcessState)
			}
			if tt.timeout > 0 && time.Since(start) > 5*time.Second {
				t.Fatalf("the context did not end the wait")
			}
		})
	}
}

func TestAwaitExitDoesNotReap(t *testing.T) {
	cmd := exec.Command("true")
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	if err := awaitExit(cmd.Process.Pid); err != nil {
		t.Fatal(err) // every kernel this runs on (5.10+) has pollable pidfds
	}
	// The exit status is still there for Wait.
	if err := cmd.Wait(); err != nil {
		t.Fatalf("wait after awaitExit: %v", err)
	}
	if !cmd.ProcessState.Success() {
		t.Fatalf("state %v", cmd.ProcessState)
	}
}

// TestWaitPolledHoldsNoThread: while a child runs, no thread of this process waits for it
// in the kernel (wchan do_wait), as one does under cmd.Wait.
func TestWaitPolledHoldsNoThread(t *testing.T) {
	if fd, err := unix.PidfdOpen(os.Getpid(), unix.PIDFD_NONBLOCK); err != nil {
		t.Skipf("no pidfd on this kernel: %v", err)
	} else {
		unix.Close(fd)
	}
	for _, tt := range []struct {
		name     string
		wait     func(*exec.Cmd) error
		wantWait bool
	}{
		{"cmd.Wait", (*exec.Cmd).Wait, true},
		{"waitPolled", waitPolled, false},
	} {
		t.Run(tt.name, func(t *testing.T) {
			cmd := exec.Command("sleep", "0.3")
			if err := cmd.Start(); err != nil {
				t.Fatal(err)
			}
			done := make(chan error, 1)
			go func() { done <- tt.wait(cmd) }()
			time.Sleep(150 * time.Millisecond)
			if got := threadsIn("do_wait"); (got > 0) != tt.wantWait {
				t.Errorf("%d threads in do_wait, want any: %v", got, tt.wantWait)
			}
			if err := <-done; err != nil {
				t.Fatal(err)
			}
		})
	}
}

func threadsIn(wchan string) int {
	tasks, _ := os.ReadDir("/proc/self/task")
	n := 0
	for _, e := range tasks {
		if b, err := os.ReadFile("/proc/self/task/" + e.Name() + "/wchan"); err == nil && string(b) == wchan {
			n++
		}
	}
	return n
}
