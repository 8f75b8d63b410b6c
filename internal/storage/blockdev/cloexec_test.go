package blockdev

import (
	"context"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/aenv-dev/aenv/internal/storage/stack"
	"golang.org/x/sys/unix"
)

// TestFuseFDsCloseOnExec: a child started while a device is mounted inherits no /dev/fuse
// descriptor. One that did would keep the connection open after the node died, with no
// server, and wedge the loop device and the ext4 above it.
func TestFuseFDsCloseOnExec(t *testing.T) {
	requireRoot(t)
	ctx := context.Background()
	dir := t.TempDir()
	s, err := stack.Open(ctx, &stack.Manifest{Dir: dir, VirtualSize: 16 << 20,
		Upper: &stack.Upper{Data: "u.data", Index: "u.index"}}, stack.Options{})
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	ex, err := Expose(ctx, filepath.Join(dir, "blk"), s, MountOptions{})
	if err != nil {
		t.Fatal(err)
	}
	defer ex.Close() // idempotent

	var ours []int
	ents, err := os.ReadDir("/proc/self/fd")
	if err != nil {
		t.Fatal(err)
	}
	for _, e := range ents {
		if l, err := os.Readlink(filepath.Join("/proc/self/fd", e.Name())); err == nil && l == "/dev/fuse" {
			fd, _ := strconv.Atoi(e.Name())
			ours = append(ours, fd)
		}
	}
	if len(ours) == 0 {
		t.Fatal("no /dev/fuse descriptor in this process while a device is mounted")
	}
	for _, fd := range ours {
		if fl, err := unix.FcntlInt(uintptr(fd), unix.F_GETFD, 0); err != nil || fl&unix.FD_CLOEXEC == 0 {
			t.Errorf("/dev/fuse fd %d is not close-on-exec (flags %#x, %v)", fd, fl, err)
		}
	}
	out, err := exec.Command("/bin/sh", "-c", `for f in /proc/$$/fd/*; do echo "$f $(readlink "$f")"; done`).CombinedOutput()
	if err != nil {
		t.Fatalf("child: %v: %s", err, out)
	}
	if strings.Contains(string(out), "/dev/fuse") {
		t.Fatalf("child inherited a FUSE connection:\n%s", out)
	}
	if err := ex.Close(); err != nil {
		t.Fatal(err)
	}
	// go-fuse closes its descriptor just after its serve loops end, which Close waits for.
	for deadline := time.Now().Add(2 * time.Second); len(fuseFDs()) > 0; time.Sleep(10 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatalf("/dev/fuse fds %v still open after Close", fuseFDs())
		}
	}
}
