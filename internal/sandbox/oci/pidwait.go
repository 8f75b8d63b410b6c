package oci

import (
	"errors"
	"os"
	"os/exec"

	"golang.org/x/sys/unix"
)

// waitPolled is cmd.Wait for a started cmd, but it waits for the process's exit in Go's
// network poller, through a non-blocking pidfd, and reaps it only once it has exited.
//
// cmd.Wait blocks a thread in waitid for the whole run: `runc create` takes 30–50 ms,
// and while a thread holds its P in a system call the runtime's monitor (sysmon) cannot
// sleep. It polls every 20 µs for the first millisecond, takes the P back after 10 ms and
// starts polling at 20 µs again: ~100 wakes of its own per runc run, each a switch to and
// from the monitor's thread. Parked in the poller, the goroutine holds no P, and an idle
// node's monitor sleeps.
func waitPolled(cmd *exec.Cmd) error {
	if err := awaitExit(cmd.Process.Pid); err != nil && !errors.Is(err, errNoPidfd) {
		return err
	}
	return cmd.Wait()
}

// runPolled is cmd.Run with waitPolled's wait.
func runPolled(cmd *exec.Cmd) error {
	if err := cmd.Start(); err != nil {
		return err
	}
	return waitPolled(cmd)
}

// errNoPidfd: the kernel cannot give a pollable pidfd (before Linux 5.10); cmd.Wait
// waits in waitid instead.
var errNoPidfd = errors.New("oci: no pollable pidfd")

// awaitExit returns once the child pid has exited, without reaping it.
func awaitExit(pid int) error {
	fd, err := unix.PidfdOpen(pid, unix.PIDFD_NONBLOCK)
	if err != nil {
		return errNoPidfd
	}
	// Non-blocking, so os.NewFile registers it with the poller.
	f := os.NewFile(uintptr(fd), "pidfd")
	defer f.Close()
	rc, err := f.SyscallConn()
	if err != nil {
		return errNoPidfd
	}
	var werr error
	if err := rc.Read(func(fd uintptr) bool {
		var info unix.Siginfo
		werr = unix.Waitid(unix.P_PIDFD, int(fd), &info, unix.WEXITED|unix.WNOHANG|unix.WNOWAIT, nil)
		if errors.Is(werr, unix.EINTR) {
			return false
		}
		// With WNOHANG the kernel reports a child that has not exited with signo 0.
		return werr != nil || info.Signo == int32(unix.SIGCHLD)
	}); err != nil {
		return errNoPidfd
	}
	if werr != nil {
		return errNoPidfd
	}
	return nil
}
