package integration

import (
	"bytes"
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/aenv-dev/aenv/internal/bench"
)

// node is one `aenv serve` subprocess on a loopback port and its own data directory.
type node struct {
	t       testing.TB
	bins    binaries
	dataDir string
	addr    string // host:port of the API
	key     string
	env     []string // extra AENV_* settings

	mu   sync.Mutex
	cmd  *exec.Cmd
	done chan struct{} // closed when the process has exited
	log  *syncBuffer
	// seen records every container (by container id) and network namespace this node's
	// backend was observed to own, so leak checks know what to look for.
	seen *ownership
	// net names the node's bridge, slots and cgroup parent; zero means the defaults.
	net nodeNet
	// netns, when set, is the network namespace the node runs in (its own address on a
	// test bridge); empty runs it in the test's namespace, on loopback.
	netns string
}

// syncBuffer collects a subprocess's output from its two pipes.
type syncBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (s *syncBuffer) Write(p []byte) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.Write(p)
}

func (s *syncBuffer) String() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.String()
}

// newNode prepares a node with a fresh data directory; start runs it. Everything the node
// leaves behind is removed when the test ends, whatever its outcome.
func newNode(t testing.TB, env ...string) *node {
	t.Helper()
	bins := needNode(t)
	dd, err := os.MkdirTemp("", "aenv-it-")
	if err != nil {
		t.Fatal(err)
	}
	// Sandbox roots in user namespaces must traverse the data dir (MkdirTemp makes 0700).
	if err := os.Chmod(dd, 0o711); err != nil {
		t.Fatal(err)
	}
	net := uniqueNet(t)
	n := &node{t: t, bins: bins, dataDir: dd, key: "e2b_" + randHex(20), env: append(net.env(), env...), seen: newOwnership(), net: net}
	t.Cleanup(func() {
		n.kill9()
		if t.Failed() {
			t.Logf("aenv serve (%s) output:\n%s", net.prefix, n.output())
		}
		forceCleanup(t, dd, n.seen)
		removeDataPlaneCgroup(dd)
		net.teardown(t)
		os.RemoveAll(dd)
	})
	return n
}

// uniqueNet picks network and cgroup names no other node on the host uses: a node's
// startup sweep removes every slot, nftables table and cgroup of its names it does not
// know, so nodes sharing names would remove each other's sandboxes. A name is held by a
// lock on a file under netNameLocks until the test's cleanups are done, so two nodes
// prepared before either made its bridge (two in one test, or tests in two packages) never
// get the same one; the kernel drops the lock of a test process that dies.
func uniqueNet(t testing.TB) nodeNet {
	t.Helper()
	if err := os.MkdirAll(netNameLocks, 0o755); err != nil {
		t.Fatal(err)
	}
	for range 1000 {
		var b [1]byte
		if _, err := rand.Read(b[:]); err != nil {
			t.Fatal(err)
		}
		k := int(b[0])
		name := fmt.Sprintf("ait%d", k)
		lock, ok := lockNetName(t, name)
		if !ok {
			continue
		}
		if _, err := os.Stat("/sys/class/net/" + name); err == nil || len(aenvNetns(name)) > 0 {
			lock.Close() // a bridge or namespaces of that name: a node outside the tests'
			continue
		}
		// Registered before the node's own cleanups, so it runs after them: the name stays
		// held until its node was killed and its names torn down.
		t.Cleanup(func() { lock.Close() })
		return nodeNet{bridge: name, prefix: name, subnet: fmt.Sprintf("10.95.%d.0/24", k),
			cgroup: fmt.Sprintf("aenv-it/%d-%d", os.Getpid(), k)}
	}
	t.Fatal("no free network names for a test node")
	return nodeNet{}
}

// netNameLocks holds one lock file per test node name.
const netNameLocks = "/run/aenv-it-names"

// lockNetName takes the host-wide lock of a test node name without waiting; ok is false
// when another node (in this process or another) holds it.
func lockNetName(t testing.TB, name string) (*os.File, bool) {
	t.Helper()
	f, err := os.OpenFile(filepath.Join(netNameLocks, name), os.O_RDWR|os.O_CREATE, 0o644)
	if err != nil {
		t.Fatal(err)
	}
	// flock locks belong to the open file, so a second open in this process conflicts too.
	if err := syscall.Flock(int(f.Fd()), syscall.LOCK_EX|syscall.LOCK_NB); err != nil {
		f.Close()
		if errors.Is(err, syscall.EWOULDBLOCK) {
			return nil, false
		}
		t.Fatalf("lock test node name %s: %v", name, err)
	}
	return f, true
}

func randHex(n int) string {
	b := make([]byte, n)
	if _, err := rand.Read(b); err != nil {
		panic(err)
	}
	return hex.EncodeToString(b)
}

func freePort(t testing.TB) int {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	return l.Addr().(*net.TCPAddr).Port
}

// start runs `aenv serve` (on a new port the first time, the same one after) and waits for
// GET /health to answer 204.
func (n *node) start() {
	n.t.Helper()
	n.launch()
	n.waitHealthy()
}

// launch starts `aenv serve` without waiting for it: nodes started with launch one after
// the other and then waited for with waitHealthy start side by side.
func (n *node) launch() {
	n.t.Helper()
	n.mu.Lock()
	if n.cmd != nil {
		n.mu.Unlock()
		n.t.Fatal("node already running")
	}
	if n.addr == "" {
		n.addr = fmt.Sprintf("127.0.0.1:%d", freePort(n.t))
	}
	if n.log == nil {
		n.log = &syncBuffer{}
	}
	cmd := exec.Command(n.bins.aenv, "serve", "--listen", n.addr, "--data-dir", n.dataDir,
		"--envd", n.bins.envd, "--base-rootfs", n.bins.baseRootFS)
	cmd.Env = append(os.Environ(), "AENV_API_KEY="+n.key, "AENV_LOG_LEVEL=info")
	cmd.Env = append(cmd.Env, n.env...)
	cmd.Stdout, cmd.Stderr = n.log, n.log
	// A test binary that dies takes its node with it (as a crash would).
	cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
	fmt.Fprintf(n.log, "--- start %s\n", time.Now().Format(time.RFC3339Nano))
	if err := n.startCmd(cmd); err != nil {
		n.mu.Unlock()
		n.t.Fatalf("start aenv serve: %v", err)
	}
	done := make(chan struct{})
	go func() { _ = cmd.Wait(); close(done) }()
	n.cmd, n.done = cmd, done
	n.mu.Unlock()
}

// waitHealthy waits until the launched node's GET /health answers 204.
func (n *node) waitHealthy() {
	n.t.Helper()
	n.mu.Lock()
	cmd, done := n.cmd, n.done
	n.mu.Unlock()
	if cmd == nil {
		n.t.Fatal("node not running")
	}
	deadline := time.Now().Add(60 * time.Second)
	for time.Now().Before(deadline) {
		select {
		case <-done:
			n.t.Fatalf("aenv serve exited during startup (%v):\n%s", cmd.ProcessState, n.output())
		default:
		}
		resp, err := http.Get(n.url() + "/health")
		if err == nil {
			resp.Body.Close()
			if resp.StatusCode == http.StatusNoContent {
				return
			}
		}
		time.Sleep(50 * time.Millisecond)
	}
	n.t.Fatalf("aenv serve did not answer /health within 60 s:\n%s", n.output())
}

// startCmd starts cmd, inside the node's network namespace when it has one: the child is
// forked from a thread switched into it, so it and everything it starts live there.
func (n *node) startCmd(cmd *exec.Cmd) error {
	if n.netns == "" {
		return cmd.Start()
	}
	return runInNetns(n.netns, cmd.Start)
}

func (n *node) url() string { return "http://" + n.addr }

func (n *node) output() string {
	if n.log == nil {
		return ""
	}
	return n.log.String()
}

// client is a REST + envd client of this node (the one `aenv bench` uses).
func (n *node) client() *bench.Client {
	c := bench.NewClient(n.url(), n.key, 4)
	n.t.Cleanup(c.Close)
	return c
}

// pid is the serve process's pid, or 0 when it is not running.
func (n *node) pid() int {
	n.mu.Lock()
	defer n.mu.Unlock()
	if n.cmd == nil {
		return 0
	}
	return n.cmd.Process.Pid
}

// kill9 kills the serve process without letting it clean up (a crash). No-op when stopped.
func (n *node) kill9() {
	n.signal(syscall.SIGKILL, 10*time.Second)
}

// stop sends SIGTERM and waits for a graceful exit; it fails the test when the node does
// not exit in time or exits with an error.
func (n *node) stop() {
	n.t.Helper()
	if err := n.signal(syscall.SIGTERM, 90*time.Second); err != nil {
		n.t.Fatalf("stop aenv serve: %v\n%s", err, n.output())
	}
}

func (n *node) signal(sig syscall.Signal, wait time.Duration) error {
	n.mu.Lock()
	cmd, done := n.cmd, n.done
	n.mu.Unlock()
	if cmd == nil {
		return nil
	}
	_ = cmd.Process.Signal(sig)
	select {
	case <-done:
	case <-time.After(wait):
		_ = cmd.Process.Kill()
		select {
		case <-done:
		case <-time.After(10 * time.Second):
			// Killed while one of its threads waited on a FUSE request only it could
			// answer: it cannot finish exiting until the connections are aborted.
			n.t.Logf("aenv serve did not exit after SIGKILL; aborted %d FUSE connections under its data dir", abortFUSE(n.dataDir))
			<-done
		}
		n.mu.Lock()
		n.cmd, n.done = nil, nil
		n.mu.Unlock()
		return fmt.Errorf("did not exit within %s of %v", wait, sig)
	}
	n.mu.Lock()
	n.cmd, n.done = nil, nil
	n.mu.Unlock()
	if sig != syscall.SIGKILL && !cmd.ProcessState.Success() {
		return fmt.Errorf("exited with %v", cmd.ProcessState)
	}
	return nil
}

// create makes a sandbox through POST /v2/sandboxes and records what its container owns.
func (n *node) create(ctx context.Context, c *bench.Client) bench.Sandbox {
	n.t.Helper()
	sb, err := c.Create(ctx, bench.CreateRequest{TemplateID: "base-minimal", Timeout: 600, Secure: true})
	if err != nil {
		n.t.Fatalf("create: %v", err)
	}
	n.observe()
	return sb
}

// observe records the containers and network slots the node's backend has on disk now.
func (n *node) observe() {
	n.t.Helper()
	if err := n.seen.scan(n.dataDir, n.netnsPrefix()); err != nil {
		n.t.Fatal(err)
	}
}

// netnsPrefix is the prefix of the node's network namespace names ("<prefix>-<slot>").
func (n *node) netnsPrefix() string {
	if n.net.prefix == "" {
		return "aenv"
	}
	return n.net.prefix
}

// cgroupParent is the cgroup the node's sandboxes live under.
func (n *node) cgroupParent() string {
	if n.net.cgroup == "" {
		return "aenv"
	}
	return n.net.cgroup
}

// run runs cmdline in sb and returns its stdout; a failure or non-zero exit fails the test.
func run(ctx context.Context, t testing.TB, c *bench.Client, sb bench.Sandbox, cmdline string) string {
	t.Helper()
	res, err := c.Run(ctx, sb, cmdline)
	if err != nil {
		t.Fatalf("run %q in %s: %v", cmdline, sb.ID, err)
	}
	if res.ExitCode != 0 {
		t.Fatalf("run %q in %s: exit %d: %s%s", cmdline, sb.ID, res.ExitCode, res.Stdout, res.Stderr)
	}
	return strings.TrimSpace(res.Stdout)
}

// states lists the node's sandboxes as id → state.
func states(ctx context.Context, t testing.TB, c *bench.Client) map[string]string {
	t.Helper()
	list, err := c.List(ctx)
	if err != nil {
		t.Fatalf("list: %v", err)
	}
	out := map[string]string{}
	for _, s := range list {
		out[s.ID] = s.State
	}
	return out
}

// killAll kills every sandbox of the node through the API.
func killAll(ctx context.Context, t testing.TB, c *bench.Client) {
	t.Helper()
	var errs []error
	for id := range states(ctx, t, c) {
		errs = append(errs, c.Kill(ctx, id))
	}
	if err := errors.Join(errs...); err != nil {
		t.Fatalf("kill: %v", err)
	}
	if left := states(ctx, t, c); len(left) != 0 {
		t.Fatalf("sandboxes left after killing all: %v", left)
	}
}
