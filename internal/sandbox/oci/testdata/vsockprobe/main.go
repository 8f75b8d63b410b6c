// vsockprobe creates an AF_VSOCK socket and an AF_INET one and prints how each went:
// "vsock=<ok|errno name> inet=<ok|errno name>". TestSeccompVsock runs it in a sandbox.
package main

import (
	"errors"
	"fmt"

	"golang.org/x/sys/unix"
)

func try(domain int) string {
	fd, err := unix.Socket(domain, unix.SOCK_STREAM, 0)
	if err != nil {
		var errno unix.Errno
		if errors.As(err, &errno) {
			return unix.ErrnoName(errno)
		}
		return err.Error()
	}
	unix.Close(fd)
	return "ok"
}

func main() {
	fmt.Printf("vsock=%s inet=%s\n", try(unix.AF_VSOCK), try(unix.AF_INET))
}
