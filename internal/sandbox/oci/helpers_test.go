package oci

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/aenv-dev/aenv/internal/network"
	"github.com/aenv-dev/aenv/internal/rootfs"
	"github.com/aenv-dev/aenv/internal/sandbox"
	"github.com/aenv-dev/aenv/internal/template/base"
	"github.com/vishvananda/netlink"
	"golang.org/x/sys/unix"
)

// Names no other package's tests use, so parallel test binaries never sweep each other.
const (
	testBridge = "aenvocit0"
	testPrefix = "aenvot"
	testSubnet = "10.89.16.0/24"
	testCgroup = "aenv-ocitest"
)

func testNetwork(pool int) network.Config {
	return network.Config{Bridge: testBridge, Subnet: testSubnet, Prefix: testPrefix, PoolSize: pool}
}

func needRuntime(t testing.TB) {
	t.Helper()
	if os.Geteuid() != 0 {
		t.Skip("needs root (runc, netns, overlayfs)")
	}
	if _, err := exec.LookPath("runc"); err != nil {
		t.Skip("needs runc (Debian package runc)")
	}
	for _, p := range []string{"/bin/busybox", "/bin/bash-static"} {
		if _, err := os.Stat(p); err != nil {
			t.Skipf("needs %s (busybox-static, bash-static)", p)
		}
	}
}

// eachRuntime runs f as a subtest per OCI runtime the backend supports: runc, and crun,
// whose path differs (its cgroup view, spec version and error messages; see
// runtimeCLI.cgroupView). A runtime that is not installed skips its subtest.
func eachRuntime(t *testing.T, f func(t *testing.T, runtime string)) {
	for _, rt := range []string{"runc", "crun"} {
		t.Run(rt, func(t *testing.T) {
			if _, err := exec.LookPath(rt); err != nil {
				t.Skipf("needs %s (Debian package %s; scripts/deps.sh --test installs it)", rt, rt)
			}
			f(t, rt)
		})
	}
}

var (
	backendSeq   atomic.Int64
	templateOnce sync.Once
	templateDir  string
	templateErr  error
	envdOnce     sync.Once
	envdBin      string
)

// testTemplate builds the base template once per test binary (removed by TestMain).
func testTemplate(t testing.TB) string {
	t.Helper()
	templateOnce.Do(func() {
		dir, err := os.MkdirTemp("", "aenv-oci-template-")
		if err != nil {
			templateErr = err
			return
		}
		templateDir = filepath.Join(dir, "base")
		templateErr = base.Build(context.Background(), base.Options{Out: templateDir})
	})
	if templateErr != nil {
		t.Fatal(templateErr)
	}
	return templateDir
}

// testEnvd returns the real envd if it builds and answers --help, else "" (tests then use
// a busybox httpd init that serves /health on the envd port).
func testEnvd(t testing.TB) string {
	t.Helper()
	envdOnce.Do(func() {
		_, file, _, _ := runtime.Caller(0)
		repo := filepath.Join(filepath.Dir(file), "..", "..", "..")
		out := filepath.Join(os.TempDir(), fmt.Sprintf("aenv-oci-envd-%d", os.Getpid()))
		cmd := exec.Command("go", "build", "-o", out, "./cmd/envd")
		cmd.Dir = repo
		cmd.Env = append(os.Environ(), "CGO_ENABLED=0")
		if err := cmd.Run(); err != nil {
			return
		}
		if err := exec.Command(out, "--help").Run(); err != nil {
			os.Remove(out)
			return
		}
		envdBin = out
	})
	return envdBin
}

func TestMain(m *testing.M) {
	if spec := os.Getenv(crashChildEnv); spec != "" {
		if err := crashChild(spec); err != nil {
			fmt.Fprintln(os.Stderr, "crash child:", err)
			os.Exit(1)
		}
		os.Exit(0)
	}
	code := m.Run()
	if templateDir != "" {
		os.RemoveAll(filepath.Dir(templateDir))
	}
	for _, bin := range []string{envdBin, waitInitBin} {
		if bin != "" {
			os.Remove(bin)
		}
	}
	// Each backend's cgroups are removed by its cleanup; the shared parent is the suite's.
	parents, _ := filepath.Glob("/sys/fs/cgroup/*/" + testCgroup)
	for _, p := range parents {
		os.Remove(p)
	}
	os.Exit(code)
}

// cmdPort is where the test init serves a shell (see httpdInit).
const cmdPort = 5000

// httpdInit stands in for envd: it serves GET /health on the envd port and, as PID 1, a
// shell per connection on cmdPort, so tests run commands as children of the sandbox's init
// with all its restrictions (user namespace, seccomp, capabilities, cgroup). `runc exec`
// cannot be used: runc 1.1 joins the user namespace before the network namespace, which the
// host owns, and fails (see the package docs).
var httpdInit = []string{"/bin/busybox", "sh", "-c",
	"mkdir -p /run/www && echo ok > /run/www/health && /bin/busybox httpd -p 49983 -h /run/www && " +
		"exec /bin/busybox nc -ll -p 5000 -e /bin/sh"}

type testEnv struct {
	b        *Backend
	cfg      Config
	template string
}

// newTestBackend makes a backend in a temp data dir and, when the test ends, stops
// everything it launched and checks that nothing (mounts, netns, veths, containers,
// cgroups, nft tables) is left.
func newTestBackend(t *testing.T, mod func(*Config)) *testEnv {
	t.Helper()
	needRuntime(t)
	tmpl := testTemplate(t)
	init := waitInit(t)
	dataDir := t.TempDir()
	// t.TempDir's parents are 0700; user-namespaced sandbox roots must traverse them.
	for d := dataDir; d != os.TempDir() && d != "/"; d = filepath.Dir(d) {
		os.Chmod(d, 0o711)
	}
	cfg := Config{
		DataDir: dataDir,
		// waitinit runs httpdInit once the root's busybox is there: at once, or in a
		// blank warm container once it is moved onto its root.
		EnvdPath:     waitInitBin,
		InitArgs:     init,
		CgroupParent: fmt.Sprintf("%s/%d-%d", testCgroup, os.Getpid(), backendSeq.Add(1)),
		PidsLimit:    256,
		// Off by default so each test controls what exists; TestWarmContainers turns it on.
		WarmContainers: -1,
		// A small block in the host-wide uid record: many test backends run at once.
		UIDRanges: 64,
		// No warm pool: it could refill a freed slot index before assertGone looks at it.
		Network: testNetwork(-1),
	}
	// runc, whose own paths (its start without `runc start`, its state read directly, its
	// sealed copy) only these tests cover, while nodes pick crun where it is installed;
	// AENV_TEST_OCI_RUNTIME names another (crun, auto) to run the whole package on it.
	// Tests that run on each runtime (eachRuntime) set it in mod.
	cfg.Runtime = "runc"
	if r := os.Getenv("AENV_TEST_OCI_RUNTIME"); r != "" {
		cfg.Runtime = r
	}
	if mod != nil {
		mod(&cfg)
	}
	ctx := context.Background()
	b, err := New(ctx, cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { cleanupBackend(t, b) })
	if _, err := b.Reconcile(ctx, nil); err != nil {
		t.Fatal(err)
	}
	return &testEnv{b: b, cfg: b.cfg, template: tmpl}
}

func cleanupBackend(t *testing.T, b *Backend) {
	ctx := context.Background()
	b.mu.Lock()
	var insts []*Instance
	for _, i := range b.instances {
		insts = append(insts, i)
	}
	b.mu.Unlock()
	for _, i := range insts {
		if err := i.Stop(ctx); err != nil {
			t.Errorf("stop %s: %v", i.id, err)
		}
	}
	if err := b.warm.close(ctx); err != nil {
		t.Errorf("warm pool close: %v", err)
	}
	if err := b.pool.Teardown(ctx); err != nil {
		t.Errorf("network teardown: %v", err)
	}
	releaseSandboxesMount(t, b)
	assertClean(t, b)
	for _, d := range cgroupDirs("/"+b.cfg.CgroupParent, b.v2) {
		os.Remove(d) // the (empty) parent cgroup; its parent testCgroup is shared and stays
	}
}

// releaseSandboxesMount unmounts the data directory's bind onto itself (the node
// keeps it across restarts), so the test's directory can be removed.
func releaseSandboxesMount(t *testing.T, b *Backend) {
	t.Helper()
	if b.rt.ns == nil {
		return
	}
	if err := unix.Unmount(b.rt.ns.root, unix.MNT_DETACH); err != nil && !errors.Is(err, unix.EINVAL) {
		t.Errorf("unmount %s: %v", b.rt.ns.root, err)
	}
}

// assertClean checks the host holds nothing of this backend.
func assertClean(t *testing.T, b *Backend) {
	t.Helper()
	if m, _ := mountsUnder(b.cfg.DataDir); len(m) > 0 && (len(m) > 1 || m[0] != filepath.Clean(b.cfg.DataDir)) {
		t.Errorf("mounts left: %v", m)
	}
	if cs, _ := b.rt.list(context.Background()); len(cs) > 0 {
		t.Errorf("containers left: %v", cs)
	}
	for _, d := range cgroupDirs("/"+b.cfg.CgroupParent, b.v2) {
		if ents, err := os.ReadDir(d); err == nil && len(ents) > 0 {
			for _, e := range ents {
				if e.IsDir() {
					t.Errorf("cgroup left: %s/%s", d, e.Name())
				}
			}
		}
	}
	ents, _ := os.ReadDir("/run/netns")
	for _, e := range ents {
		if strings.HasPrefix(e.Name(), b.cfg.Network.Prefix+"-") {
			t.Errorf("netns left: %s", e.Name())
		}
	}
	settleNetwork(t, b.pool)
	links, _ := netlink.LinkList()
	for _, l := range links {
		if strings.HasPrefix(l.Attrs().Name, b.cfg.Network.Prefix+"h") {
			t.Errorf("veth left: %s", l.Attrs().Name)
		}
	}
}

// settleNetwork waits for the veths of released slots, which go after the release
// (network.Pool.Settle).
func settleNetwork(t *testing.T, p *network.Pool) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if err := p.Settle(ctx); err != nil {
		t.Errorf("released slots' veths not gone: %v", err)
	}
}

// slotTrace names one slot's namespace and host veth by identity, not only by name: the
// warm filler may build a new slot of the same index, so of the same names, as soon as a
// stopped sandbox's slot is free (the CI failed on that once).
type slotTrace struct {
	netns   string
	mount   netnsMount
	veth    string
	ifindex int // interface indexes are not reused soon
}

// netnsMount identifies the bind mount that holds a named namespace: by the mount's unique
// id where the kernel has one (6.8+); else by the namespace's inode, which the kernel may
// give a new namespace once the old one is freed.
type netnsMount struct {
	unique bool
	id     uint64
}

func statNetns(path string) (netnsMount, error) {
	var st unix.Statx_t
	if err := unix.Statx(unix.AT_FDCWD, path, 0, unix.STATX_INO|unix.STATX_MNT_ID_UNIQUE, &st); err != nil {
		return netnsMount{}, err
	}
	if st.Mask&unix.STATX_MNT_ID_UNIQUE != 0 {
		return netnsMount{unique: true, id: st.Mnt_id}, nil
	}
	return netnsMount{id: st.Ino}, nil
}

// traceSlot records s's identity; take it before the sandbox stops. nil for nil.
func traceSlot(t *testing.T, s *network.Slot) *slotTrace {
	t.Helper()
	if s == nil {
		return nil
	}
	m, err := statNetns(s.NetnsPath)
	if err != nil {
		t.Fatalf("slot's netns: %v", err)
	}
	l, err := netlink.LinkByName(s.HostVeth)
	if err != nil {
		t.Fatalf("slot's veth: %v", err)
	}
	return &slotTrace{netns: s.NetnsPath, mount: m, veth: s.HostVeth, ifindex: l.Attrs().Index}
}

// assertGone checks that a stopped container (by container id) left nothing: container,
// cgroups, mounts, bundle, and the namespace and veth of its slot (traced before the stop).
func assertGone(t *testing.T, b *Backend, id string, slot *slotTrace) {
	t.Helper()
	if _, err := b.rt.state(context.Background(), id); err == nil {
		t.Errorf("container %s still exists", id)
	}
	for _, d := range cgroupDirs(b.cgroupsPath(id), b.v2) {
		if _, err := os.Stat(d); err == nil {
			t.Errorf("cgroup left: %s", d)
		}
	}
	l := b.layout(id)
	if m, _ := mountsUnder(l.dir); len(m) > 0 {
		t.Errorf("mounts left: %v", m)
	}
	if _, err := os.Stat(l.dir); err == nil {
		t.Errorf("bundle left: %s", l.dir)
	}
	if slot != nil {
		if m, err := statNetns(slot.netns); err == nil && m == slot.mount {
			t.Errorf("netns left: %s", slot.netns)
		}
		settleNetwork(t, b.pool)
		if l, err := netlink.LinkByIndex(slot.ifindex); err == nil && l.Attrs().Name == slot.veth {
			t.Errorf("veth left: %s", slot.veth)
		}
	}
}

func (e *testEnv) launch(t *testing.T, id string, res sandbox.Resources) *Instance {
	t.Helper()
	inst, err := e.b.Launch(context.Background(), sandbox.LaunchPlan{
		Kind: sandbox.LaunchFresh, SandboxID: id, RootFS: sandbox.RootFS{LowerDir: e.template},
		Resources: res, AllowInternet: true,
	})
	if err != nil {
		t.Fatal(err)
	}
	i := inst.(*Instance)
	e.waitReady(t, i)
	return i
}

// waitReady polls the init's HTTP port from the host, as the orchestrator does with envd.
func (e *testEnv) waitReady(t testing.TB, i *Instance) {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for {
		if err := probeHealth(i, 200*time.Millisecond); err == nil {
			return
		} else if time.Now().After(deadline) {
			log, _ := os.ReadFile(i.l.log())
			t.Fatalf("init of %s not ready: %v; log: %s", i.id, err, log)
		}
		time.Sleep(2 * time.Millisecond)
	}
}

func probeHealth(i *Instance, timeout time.Duration) error {
	ep := i.Endpoint()
	c := http.Client{Timeout: timeout}
	resp, err := c.Get(fmt.Sprintf("http://%s:%d/health", ep.Host, ep.EnvdPort))
	if err != nil {
		return err
	}
	resp.Body.Close()
	if resp.StatusCode >= 300 {
		return fmt.Errorf("health: %s", resp.Status)
	}
	return nil
}

// sh runs a shell script inside the sandbox through the test init's command port and
// returns its combined output and exit code.
func (e *testEnv) sh(t testing.TB, i *Instance, script string) (string, int) {
	t.Helper()
	addr := net.JoinHostPort(i.Endpoint().Host, strconv.Itoa(cmdPort))
	// The init starts the command server just after httpd, so it may trail readiness.
	var c net.Conn
	var err error
	for deadline := time.Now().Add(5 * time.Second); ; time.Sleep(5 * time.Millisecond) {
		if c, err = net.DialTimeout("tcp", addr, 5*time.Second); err == nil {
			break
		} else if time.Now().After(deadline) {
			t.Fatalf("command port: %v", err)
		}
	}
	defer c.Close()
	c.SetDeadline(time.Now().Add(60 * time.Second))
	if _, err := io.WriteString(c, "exec 2>&1\n"+script+"\necho \"__EXIT:$?\"\n"); err != nil {
		t.Fatal(err)
	}
	c.(*net.TCPConn).CloseWrite()
	out, err := io.ReadAll(c)
	if err != nil {
		t.Fatalf("command output: %v", err)
	}
	s := string(out)
	k := strings.LastIndex(s, "__EXIT:")
	if k < 0 {
		t.Fatalf("no exit status in %q", s)
	}
	code, _ := strconv.Atoi(strings.TrimSpace(s[k+7:]))
	return s[:k], code
}

// blockOf is i's block root, nil when it has none.
func blockOf(i *Instance) *rootfs.Block {
	r, _ := i.root.(blockRoot)
	return r.Block
}
