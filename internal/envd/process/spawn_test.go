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
