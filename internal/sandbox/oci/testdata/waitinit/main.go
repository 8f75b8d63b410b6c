// Command waitinit is the tests' init for blank warm containers (see reroot.go): started
// on the blank root, which holds none of the root's files, it waits until its first
// argument exists (the container was moved onto its root) and then runs it.
package main

import (
	"os"
	"syscall"
	"time"
)

func main() {
	if len(os.Args) < 2 {
		os.Stderr.WriteString("usage: waitinit PROGRAM [ARG...]\n")
		os.Exit(2)
	}
	for {
		if _, err := os.Stat(os.Args[1]); err == nil {
			break
		}
		time.Sleep(2 * time.Millisecond)
	}
	err := syscall.Exec(os.Args[1], os.Args[1:], os.Environ())
	os.Stderr.WriteString("waitinit: " + err.Error() + "\n")
	os.Exit(1)
}
