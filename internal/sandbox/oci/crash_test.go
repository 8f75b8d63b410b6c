package oci

import (
	"bufio"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/aenv-dev/aenv/internal/sandbox"
	"golang.org/x/sys/unix"
)

// crashChildEnv makes the test binary run crashChild with the spec it holds (JSON).
const crashChildEnv = "AENV_OCI_CRASH_CHILD"

// crashSpec is what the crash child needs to make the same backend as its parent.
type crashSpec struct {
	DataDir      string
	CgroupParent string
	RootFS       sandbox.RootFS
	OverlayRoots bool
}

func crashConfig(s crashSpec) Config {
	return Config{
		DataDir:        s.DataDir,
		EnvdPath:       "/bin/busybox",
		InitArgs:       httpdInit,
		CgroupParent:   s.CgroupParent,
		PidsLimit:      256,
		WarmContainers: -1,
		Network:        testNetwork(-1),
		OverlayRoots:   s.OverlayRoots,
	}
}

// crashChild is a node that dies with a block-root sandbox running: it launches one,
// leaves dirty data on its root, starts a process that holds the root's FUSE connection
// open (as an orphaned runc once did: the kernel then does not abort the connection when
// the node dies, and the root wedges), prints "ready PID" (the holder's) and waits to be
// killed.
func crashChild(raw string) error {
	var s crashSpec
	if err := json.Unmarshal([]byte(raw), &s); err != nil {
		return err
	}
	ctx := context.Background()
	b, err := New(ctx, crashConfig(s))
	if err != nil {
		return err
	}
	if _, err := b.Reconcile(ctx, nil); err != nil {
		return err
	}
	inst, err := b.Launch(ctx, sandbox.LaunchPlan{Kind: sandbox.LaunchFresh, SandboxID: "crash-dead", RootFS: s.RootFS, AllowInternet: true})
	if err != nil {
		return err
	}
	i := inst.(*Instance)
	for deadline := time.Now().Add(10 * time.Second); probeHealth(i, 200*time.Millisecond) != nil; time.Sleep(5 * time.Millisecond) {
		if time.Now().After(deadline) {
			return fmt.Errorf("sandbox not ready")
		}
	}
	var c net.Conn
	for deadline := time.Now().Add(5 * time.Second); ; time.Sleep(5 * time.Millisecond) {
		if c, err = net.DialTimeout("tcp", net.JoinHostPort(i.Endpoint().Host, strconv.Itoa(cmdPort)), time.Second); err == nil {
			break
		} else if time.Now().After(deadline) {
			return err
		}
	}
	c.SetDeadline(time.Now().Add(30 * time.Second))
	io.WriteString(c, "dd if=/dev/zero of=/root/f bs=1M count=4 2>&1; echo __done\n")
	c.(*net.TCPConn).CloseWrite()
	out, _ := io.ReadAll(c)
	c.Close()
	if !strings.Contains(string(out), "__done") {
		return fmt.Errorf("write in sandbox: %q", out)
	}
	holder := exec.Command("sleep", "600")
	ents, _ := os.ReadDir("/proc/self/fd")
	for _, e := range ents {
		if l, err := os.Readlink(filepath.Join("/proc/self/fd", e.Name())); err == nil && l == "/dev/fuse" {
			fd, _ := strconv.Atoi(e.Name())
			holder.ExtraFiles = append(holder.ExtraFiles, os.NewFile(uintptr(fd), "/dev/fuse"))
		}
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

// TestBlockCrashDeadServer: the node serving a block-root sandbox is SIGKILLed while the
// root's FUSE connection stays open elsewhere, so nothing answers it and the kernel does
// not abort it. A new backend's Reconcile must return promptly and remove everything:
// container, mounts, loop devices, cgroups, network slot. The same for an overlay root,
// whose upper and shared lower are both served by the dead node.
func TestBlockCrashDeadServer(t *testing.T) {
	for _, overlay := range []bool{false, true} {
		t.Run(fmt.Sprintf("overlay=%v", overlay), func(t *testing.T) { testCrashDeadServer(t, overlay) })
	}
}

func testCrashDeadServer(t *testing.T, overlay bool) {
	needBlock(t)
	fs := testLayered(t)
	dataDir := t.TempDir()
	for d := dataDir; d != os.TempDir() && d != "/"; d = filepath.Dir(d) {
		os.Chmod(d, 0o711)
	}
	spec := crashSpec{DataDir: dataDir, CgroupParent: fmt.Sprintf("%s/%d-%d", testCgroup, os.Getpid(), backendSeq.Add(1)), RootFS: fs, OverlayRoots: overlay}
	raw, _ := json.Marshal(spec)
	child := exec.Command(os.Args[0], "-test.run=^$")
	child.Env = append(os.Environ(), crashChildEnv+"="+string(raw))
	child.Stderr = os.Stderr
	stdout, err := child.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := child.Start(); err != nil {
		t.Fatal(err)
	}
	holder := 0
	// Whatever happens, unwedge and remove what the child left (a failed Reconcile would
	// leave it hanging). Connection numbers are reused once a mount goes, so only those
	// still held by mounts or loop devices of dataDir are aborted.
	t.Cleanup(func() {
		child.Process.Kill()
		child.Wait()
		if holder > 0 {
			if cmd, _ := os.ReadFile(fmt.Sprintf("/proc/%d/cmdline", holder)); strings.HasPrefix(string(cmd), "sleep") {
				syscall.Kill(holder, syscall.SIGKILL)
			}
		}
		for _, c := range crashConns(t, dataDir) {
			os.WriteFile(fmt.Sprintf("/sys/fs/fuse/connections/%d/abort", c), []byte("1"), 0o200)
		}
		// What a failed Reconcile left; the loop devices autoclear once unmounted.
		m, _ := mountsUnder(dataDir)
		for i := len(m) - 1; i >= 0; i-- {
			unix.Unmount(m[i], unix.MNT_DETACH)
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
	if c := crashConns(t, dataDir); len(c) == 0 {
		t.Fatal("the child's block root has no FUSE connection")
	}
	child.Process.Signal(syscall.SIGKILL)
	child.Wait()

	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	b2, err := New(ctx, crashConfig(spec))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { cleanupBackend(t, b2) })
	type result struct {
		alive map[string]sandbox.Instance
		err   error
	}
	done := make(chan result, 1)
	go func() {
		alive, err := b2.Reconcile(ctx, []string{"crash-dead"})
		done <- result{alive, err}
	}()
	select {
	case r := <-done:
		if r.err != nil {
			t.Errorf("reconcile: %v", r.err)
		}
		if len(r.alive) != 0 {
			t.Errorf("alive %v: block sandboxes cannot be adopted", r.alive)
		}
	case <-time.After(60 * time.Second):
		t.Fatal("reconcile did not return in 60s")
	}
	// A loop device held by a dying container's mount goes once that lets go.
	for deadline := time.Now().Add(10 * time.Second); ; time.Sleep(50 * time.Millisecond) {
		left := blockLeftovers(t, dataDir)
		for _, c := range crashConns(t, dataDir) {
			left = append(left, fmt.Sprintf("fuse connection %d", c))
		}
		if len(left) == 0 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("left behind: %v", left)
		}
	}
	if cs, _ := b2.rt.list(ctx); len(cs) > 0 {
		t.Errorf("containers left: %v", cs)
	}
	statted := make(chan struct{})
	go func() { os.Stat(filepath.Join(dataDir, "sandboxes")); close(statted) }()
	select {
	case <-statted:
	case <-time.After(5 * time.Second):
		t.Fatal("stat of the data dir blocks")
	}
}

// crashConns lists the FUSE connections still held under dataDir: by its FUSE mounts, or
// by loop devices whose recorded backing file lies under it (their mount may be gone).
func crashConns(t *testing.T, dataDir string) []uint64 {
	t.Helper()
	seen := map[uint64]bool{}
	if raw, err := os.ReadFile("/proc/self/mountinfo"); err == nil {
		for _, line := range strings.Split(string(raw), "\n") {
			f := strings.Fields(line)
			if len(f) > 4 && strings.HasPrefix(f[2], "0:") && strings.HasPrefix(f[4], dataDir+"/") && strings.Contains(line, " fuse.aenv ") {
				n, _ := strconv.ParseUint(strings.TrimPrefix(f[2], "0:"), 10, 32)
				seen[n] = true
			}
		}
	}
	loops, _ := filepath.Glob("/sys/block/loop*/loop/backing_file")
	for _, bf := range loops {
		b, err := os.ReadFile(bf)
		if err != nil || (!strings.Contains(string(b), dataDir) && strings.TrimSpace(string(b)) != "/disk") {
			continue
		}
		dev := "/dev/" + filepath.Base(filepath.Dir(filepath.Dir(bf)))
		f, err := os.Open(dev)
		if err != nil {
			continue
		}
		info, err := unix.IoctlLoopGetStatus64(int(f.Fd()))
		f.Close()
		if err != nil {
			continue
		}
		name := string(info.File_name[:])
		if i := strings.IndexByte(name, 0); i >= 0 {
			name = name[:i]
		}
		if strings.HasPrefix(name, dataDir+"/") && unix.Major(info.Device) == 0 {
			seen[uint64(unix.Minor(info.Device))] = true
		}
	}
	var out []uint64
	for c := range seen {
		if _, err := os.Stat(fmt.Sprintf("/sys/fs/fuse/connections/%d", c)); err == nil {
			out = append(out, c)
		}
	}
	return out
}
