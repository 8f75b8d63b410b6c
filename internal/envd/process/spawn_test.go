package process

import (
	"fmt"
	"syscall"
	"testing"

	"connectrpc.com/connect"
)

// A fork refused because the pids limit is reached is not the caller's invalid argument.
func TestStartErrorCode(t *testing.T) {
	for _, tc := range []struct {
		err  error
		want connect.Code
	}{
		{syscall.EAGAIN, connect.CodeResourceExhausted},
		{fmt.Errorf("fork: %w", syscall.ENOMEM), connect.CodeResourceExhausted},
		{syscall.ENOENT, connect.CodeInvalidArgument},
		{syscall.EACCES, connect.CodeInvalidArgument},
		{syscall.ENOEXEC, connect.CodeInvalidArgument},
		{syscall.EIO, connect.CodeInternal},
	} {
		if got := startErrorCode(tc.err); got != tc.want {
			t.Errorf("%v: %v, want %v", tc.err, got, tc.want)
		}
	}
}

// TestChildOOMScoreAdj: a command's score is envd's plus 100, capped at the kernel's
// maximum, so it goes before envd whatever score the runtime gave envd.
func TestChildOOMScoreAdj(t *testing.T) {
	for _, tt := range []struct{ own, want int }{{0, 100}, {500, 600}, {950, 1000}, {1000, 1000}, {-500, -400}} {
		if got := childOOMScoreAdj(tt.own); got != tt.want {
			t.Errorf("childOOMScoreAdj(%d) = %d, want %d", tt.own, got, tt.want)
		}
	}
}
