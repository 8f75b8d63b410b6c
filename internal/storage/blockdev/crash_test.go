package blockdev

import (
	"bufio"
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/aenv-dev/aenv/internal/storage/stack"
	"golang.org/x/sys/unix"
)

// crashChildEnv makes the test binary act as crashChild (in the directory it names).
const crashChildEnv = "AENV_BLOCKDEV_CRASH_CHILD"

func TestMain(m *testing.M) {
	if dir := os.Getenv(crashChildEnv); dir != "" {
		if err := crashChild(dir); err != nil {
			fmt.Fprintln(os.Stderr, "crash child:", err)
			os.Exit(1)
		}
		os.Exit(0)
	}
	os.Exit(m.Run())
}

// crashChild is a node that dies with a block root in use: it serves a stack through
// FUSE, mounts ext4 from the loop device over it, leaves dirty data in it, and starts a
// process that holds the FUSE connection open (as an orphaned runc once did), so the
// kernel does not abort the connection when this process dies. It prints "ready PID"
// (the holder's) and waits to be killed.
func crashChild(dir string) error {
	ctx := context.Background()
	s, err := stack.Open(ctx, &stack.Manifest{Dir: dir, VirtualSize: 64 << 20,
		Upper: &stack.Upper{Data: "u.data", Index: "u.index"}}, stack.Options{})
	if err != nil {
		return err
	}
	ex, err := Expose(ctx, filepath.Join(dir, "blk"), s, MountOptions{})
	if err != nil {
		return err
	}
	if out, err := exec.Command("mkfs.ext4", "-q", "-F", ex.Device()).CombinedOutput(); err != nil {
		return fmt.Errorf("mkfs: %w: %s", err, out)
	}
	mnt := filepath.Join(dir, "mnt")
	if err := os.MkdirAll(mnt, 0o755); err != nil {
		return err
	}
	if err := unix.Mount(ex.Device(), mnt, "ext4", 0, ""); err != nil {
		return fmt.Errorf("mount ext4: %w", err)
	}
	if err := os.WriteFile(filepath.Join(mnt, "f"), make([]byte, 4<<20), 0o644); err != nil {
		return err
	}
	holder := exec.Command("sleep", "600")
	for _, fd := range fuseFDs() {
		holder.ExtraFiles = append(holder.ExtraFiles, os.NewFile(uintptr(fd), "/dev/fuse"))
	}
	if len(holder.ExtraFiles) == 0 {
		return fmt.Errorf("no /dev/fuse descriptor to hand on")
	}
	if err := holder.Start(); err != nil {
		return err
	}
	fmt.Printf("ready %d\n", holder.Process.Pid)
	select {}
}

// fuseFDs lists this process's /dev/fuse descriptors.
func fuseFDs() []int {
	var fds []int
	ents, _ := os.ReadDir("/proc/self/fd")
	for _, e := range ents {
		if l, err := os.Readlink(filepath.Join("/proc/self/fd", e.Name())); err == nil && l == "/dev/fuse" {
			fd, _ := strconv.Atoi(e.Name())
			fds = append(fds, fd)
		}
	}
	return fds
}

// TestSweepDeadServer: a process serving a mounted block root is SIGKILLed while its FUSE
// connection stays open elsewhere (nothing answers it, and the kernel does not abort it);
// Sweep must return promptly and leave no mount, no loop device and nothing that blocks.
func TestSweepDeadServer(t *testing.T) {
	requireRoot(t)
	dir := t.TempDir()
	child := exec.Command(os.Args[0], "-test.run=^$")
	child.Env = append(os.Environ(), crashChildEnv+"="+dir)
	child.Stderr = os.Stderr
	stdout, err := child.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := child.Start(); err != nil {
		t.Fatal(err)
	}
	var holder int
	var conn uint64
	// Whatever happens, leave nothing behind (a failed Sweep would leave the root wedged).
	// Connection numbers are reused as soon as a mount goes, so only those still held by
	// this test's mounts or loop devices are aborted.
	t.Cleanup(func() {
		child.Process.Kill()
		child.Wait()
		if holder > 0 {
			if cmd, _ := os.ReadFile(fmt.Sprintf("/proc/%d/cmdline", holder)); strings.HasPrefix(string(cmd), "sleep") {
				syscall.Kill(holder, syscall.SIGKILL)
			}
		}
		if mounts, err := readMountinfo(); err == nil {
			for _, m := range mounts {
				if m.fstype == fsType && under(m.dir, dir) {
					abortConn(m.dev)
				}
			}
		}
		loops := loopsOf(t, dir)
		for _, l := range loops {
			if unix.Major(l.conn) == 0 {
				abortConn(l.conn)
			}
		}
		if mounts, err := readMountinfo(); err == nil {
			for i := len(mounts) - 1; i >= 0; i-- {
				if under(mounts[i].dir, dir) {
					unix.Unmount(mounts[i].dir, unix.MNT_DETACH)
				}
			}
		}
		for _, l := range loops {
			clearLoop(l.path)
		}
	})
	sc := bufio.NewScanner(stdout)
	for sc.Scan() {
		if pid, ok := strings.CutPrefix(sc.Text(), "ready "); ok {
			holder, _ = strconv.Atoi(pid)
			break
		}
	}
	if holder == 0 {
		t.Fatalf("child did not get ready: %v", child.Wait())
	}
	mounts, err := readMountinfo()
	if err != nil {
		t.Fatal(err)
	}
	for _, m := range mounts {
		if m.fstype == fsType && under(m.dir, dir) {
			conn = m.dev
		}
	}
	if loops := loopsOf(t, dir); conn == 0 || len(loops) != 1 || loops[0].conn != conn {
		t.Fatalf("child's root: connection %d, loop devices %+v", conn, loops)
	}
	child.Process.Signal(syscall.SIGKILL)
	child.Wait()

	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	done := make(chan error, 1)
	go func() { done <- Sweep(ctx, dir) }()
	select {
	case err := <-done:
		if err != nil {
			t.Errorf("sweep: %v", err)
		}
	case <-time.After(30 * time.Second):
		t.Fatal("sweep did not return in 30s")
	}

	mounts, _ = readMountinfo()
	for _, m := range mounts {
		if under(m.dir, dir) {
			t.Errorf("mount left: %+v", m)
		}
	}
	// A detached loop device lets go of its file as its last opener closes it.
	deadline := time.Now().Add(5 * time.Second)
	for {
		left := loopsOf(t, dir)
		if len(left) == 0 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("loop devices left: %v", left)
		}
		time.Sleep(50 * time.Millisecond)
	}
	// Nothing that touches the former mount points blocks.
	for _, p := range []string{filepath.Join(dir, "mnt"), filepath.Join(dir, "blk", "fuse"), filepath.Join(dir, "blk", "fuse", FileName)} {
		statted := make(chan struct{})
		go func() { os.Stat(p); close(statted) }()
		select {
		case <-statted:
		case <-time.After(5 * time.Second):
			t.Fatalf("stat %s blocks", p)
		}
	}
}

// testLoop is a loop device attached to a file of a test's directory.
type testLoop struct {
	path string
	conn uint64 // the backing file's device: the FUSE connection
}

// loopsOf lists the loop devices attached to files under dir: by their backing file's
// path, or, once the FUSE mount is detached (the path shows as "/disk"), by the name
// AttachLoop recorded.
func loopsOf(t *testing.T, dir string) []testLoop {
	t.Helper()
	var out []testLoop
	for _, l := range listLoops(func(string) bool { return false }) {
		if !under(l.backing, dir) && l.backing != "/"+FileName {
			continue
		}
		info, err := loopStatus(l.path)
		if err != nil {
			continue // detached meanwhile
		}
		name := string(info.File_name[:])
		if i := strings.IndexByte(name, 0); i >= 0 {
			name = name[:i]
		}
		if under(l.backing, dir) || strings.HasPrefix(name, dir+"/") {
			out = append(out, testLoop{path: l.path, conn: info.Device})
		}
	}
	return out
}
