package microvm

import (
	"bytes"
	"context"
	"fmt"
	"log/slog"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/vishvananda/netlink"

	"github.com/aenv-dev/aenv/internal/envdclient"
	"github.com/aenv-dev/aenv/internal/network"
	"github.com/aenv-dev/aenv/internal/sandbox"
	"github.com/aenv-dev/aenv/internal/storage/lsmt"
	"github.com/aenv-dev/aenv/internal/template/base"
)

const (
	// testMemMB keeps guests small: touching guest memory under TCG is slow.
	testMemMB = 192
	// templateMB is the test template's ext4 size.
	templateMB = 256
)

var (
	backendSeq atomic.Int64
	fixOnce    sync.Once
	fix        struct {
		dir      string // removed by TestMain
		envd     string
		template sandbox.RootFS
		err      error
	}
)

// repoRoot is the repository's root directory.
func repoRoot() string {
	_, file, _, _ := runtime.Caller(0)
	return filepath.Join(filepath.Dir(file), "..", "..", "..")
}

// needVM skips unless this host can run the backend's VMs: root (netns, FUSE, taps),
// QEMU, e2fsprogs and the guest that `make guest` builds.
func needVM(t testing.TB) {
	t.Helper()
	if os.Geteuid() != 0 {
		t.Skip("needs root (netns, taps, FUSE)")
	}
	for _, p := range []string{"/dev/fuse", "/dev/net/tun", "/bin/busybox", "/bin/bash-static"} {
		if _, err := os.Stat(p); err != nil {
			t.Skipf("needs %s", p)
		}
	}
	for _, tool := range []string{"qemu-system-x86_64", "mkfs.ext4", "resize2fs"} {
		if _, err := exec.LookPath(tool); err != nil {
			t.Skipf("needs %s (qemu-system-x86, e2fsprogs)", tool)
		}
	}
	for _, f := range []string{"vmlinux", "initrd.img"} {
		if _, err := os.Stat(filepath.Join(repoRoot(), "bin", "microvm", f)); err != nil {
			t.Skipf("needs the guest (make guest): %v", err)
		}
	}
}

// fixtures builds envd and the base template as a one-layer layered template, once per
// test binary.
func fixtures(t testing.TB) {
	t.Helper()
	fixOnce.Do(func() {
		t0 := time.Now()
		defer func() { t.Logf("fixtures (envd, layered base template) in %v", time.Since(t0).Round(time.Millisecond)) }()
		fix.dir, fix.err = os.MkdirTemp("", "aenv-microvm-test-")
		if fix.err != nil {
			return
		}
		fix.envd = filepath.Join(fix.dir, "envd")
		cmd := exec.Command("go", "build", "-o", fix.envd, "./cmd/envd")
		cmd.Dir = repoRoot()
		cmd.Env = append(os.Environ(), "CGO_ENABLED=0")
		if out, err := cmd.CombinedOutput(); err != nil {
			fix.err = fmt.Errorf("build envd: %v: %s", err, out)
			return
		}
		tree := filepath.Join(fix.dir, "base")
		if fix.err = base.Build(context.Background(), base.Options{Out: tree}); fix.err != nil {
			return
		}
		var ref sandbox.LayerRef
		ref, fix.err = importDir(tree, filepath.Join(fix.dir, "base.commit"))
		fix.template = sandbox.RootFS{Layers: []sandbox.LayerRef{ref}, VirtualSize: templateMB << 20}
	})
	if fix.err != nil {
		t.Fatal(fix.err)
	}
}

// importDir makes a directory into a sealed overlaybd layer holding an ext4 filesystem.
func importDir(src, out string) (sandbox.LayerRef, error) {
	img := out + ".img"
	defer os.Remove(img)
	if b, err := exec.Command("mkfs.ext4", "-q", "-F", "-E", "root_owner=0:0", "-d", src, img, fmt.Sprintf("%dM", templateMB)).CombinedOutput(); err != nil {
		return sandbox.LayerRef{}, fmt.Errorf("mkfs.ext4: %v: %s", err, b)
	}
	raw, err := os.Open(img)
	if err != nil {
		return sandbox.LayerRef{}, err
	}
	defer raw.Close()
	f, err := os.Create(out)
	if err != nil {
		return sandbox.LayerRef{}, err
	}
	info, err := lsmt.Import(f, raw, lsmt.CommitOptions{})
	if cerr := f.Close(); err == nil {
		err = cerr
	}
	if err != nil {
		return sandbox.LayerRef{}, err
	}
	return sandbox.LayerRef{Path: out, Size: info.Size, UUID: info.UUID}, nil
}

func TestMain(m *testing.M) {
	for env, run := range map[string]func(string) error{adoptChildEnv: adoptChild, dataPlaneChildEnv: dataPlaneChild} {
		if v := os.Getenv(env); v != "" {
			if err := run(v); err != nil {
				fmt.Fprintln(os.Stderr, env, "child:", err)
				os.Exit(1)
			}
			os.Exit(0)
		}
	}
	if spec := os.Getenv(crashChildEnv); spec != "" {
		if err := crashChild(spec); err != nil {
			fmt.Fprintln(os.Stderr, "crash child:", err)
			os.Exit(1)
		}
		os.Exit(0)
	}
	code := m.Run()
	if fix.dir != "" {
		os.RemoveAll(fix.dir)
	}
	os.Exit(code)
}

// testNetwork is a network no other test binary uses: names and subnet (10.91.x.0/24,
// which no other package's tests use) follow this process's pid, so that the same tests
// run from two checkouts at once never tear down each other's bridge. The crash test's
// child gets it through its config.
func testNetwork() network.Config {
	n := os.Getpid()
	return network.Config{
		Bridge: fmt.Sprintf("mvt%d", n%100000), Prefix: fmt.Sprintf("mv%d", n%100000),
		Subnet: fmt.Sprintf("10.91.%d.0/24", n%250+1), PoolSize: -1,
	}
}

// testConfig is a backend configuration private to one test.
func testConfig(t testing.TB) Config {
	dataDir := t.TempDir()
	ram := fmt.Sprintf("/dev/shm/aenv-mvtest-%d-%d", os.Getpid(), backendSeq.Add(1))
	t.Cleanup(func() { os.RemoveAll(ram) })
	return Config{
		DataDir: dataDir, EnvdPath: fix.envd, GuestDir: filepath.Join(repoRoot(), "bin", "microvm"),
		RAMDir: ram, MemoryMB: testMemMB, Accel: AccelTCG,
		// No warm pool: it could refill a freed slot index before a test looks at it.
		Network: testNetwork(),
	}
}

// newTestBackend makes a backend and, when the test ends, stops what it launched and
// checks nothing is left. opts edit its configuration.
func newTestBackend(t testing.TB, opts ...func(*Config)) *Backend {
	t.Helper()
	needVM(t)
	fixtures(t)
	ctx := context.Background()
	cfg := testConfig(t)
	for _, o := range opts {
		o(&cfg)
	}
	if os.Getenv("AENV_TEST_DEBUG") != "" {
		cfg.Logger = slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelDebug}))
	}
	b, err := New(ctx, cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		b.vmpool.close()
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
		if err := b.pool.Teardown(ctx); err != nil {
			t.Errorf("network teardown: %v", err)
		}
		assertClean(t, b)
	})
	if _, err := b.Reconcile(ctx, nil); err != nil {
		t.Fatal(err)
	}
	return b
}

// newBenchBackend is newTestBackend with the network pool as a node has it (slots
// prepared ahead), so benchmarks time what a node does.
func newBenchBackend(b *testing.B) *Backend {
	b.Helper()
	return newTestBackend(b, func(c *Config) { c.Network.PoolSize = 0 })
}

// launch starts a fresh sandbox on the base template and waits for envd.
func launch(t testing.TB, b *Backend, id string, res sandbox.Resources) *Instance {
	t.Helper()
	t0 := time.Now()
	inst, err := b.Launch(context.Background(), sandbox.LaunchPlan{
		Kind: sandbox.LaunchFresh, SandboxID: id, RootFS: fix.template, Resources: res, AllowInternet: true,
	})
	if err != nil {
		t.Fatal(err)
	}
	i := inst.(*Instance)
	waitEnvd(t, i)
	t.Logf("%s: launch → envd answering in %v", id, time.Since(t0).Round(time.Millisecond))
	return i
}

// waitEnvd polls envd's /health from the host, as the orchestrator does.
func waitEnvd(t testing.TB, i *Instance) {
	t.Helper()
	if err := envdReady(i, 90*time.Second); err != nil {
		console, _ := os.ReadFile(i.ConsoleLog())
		qlog, _ := os.ReadFile(filepath.Join(i.dir, qemuLog))
		t.Fatalf("envd of %s: %v; QEMU %d alive: %v; qemu log: %s; console:\n%s", i.id, err, i.PID(), alive(i.PID()), qlog, console)
	}
}

func envdReady(i *Instance, timeout time.Duration) error {
	ep := i.Endpoint()
	c := http.Client{Timeout: 500 * time.Millisecond}
	url := fmt.Sprintf("http://%s:%d/health", ep.Host, ep.EnvdPort)
	deadline := time.Now().Add(timeout)
	for {
		resp, err := c.Get(url)
		if err == nil {
			resp.Body.Close()
			if resp.StatusCode < 300 {
				return nil
			}
			err = fmt.Errorf("health: %s", resp.Status)
		}
		if time.Now().After(deadline) {
			return err
		}
		time.Sleep(5 * time.Millisecond)
	}
}

// sh runs a bash script in the sandbox through envd and returns stdout, stderr and the
// exit code.
func sh(t testing.TB, i *Instance, script string) (string, string, int32) {
	t.Helper()
	ep := i.Endpoint()
	c := envdclient.New(http.DefaultClient, fmt.Sprintf("http://%s:%d", ep.Host, ep.EnvdPort))
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	p, err := c.Start(ctx, envdclient.Command{Cmd: "/bin/bash", Args: []string{"-c", script}})
	if err != nil {
		t.Fatalf("start %q in %s: %v", script, i.id, err)
	}
	defer p.Close()
	var stdout, stderr bytes.Buffer
	end, err := p.Wait(&stdout, &stderr)
	if err != nil {
		t.Fatalf("wait %q in %s: %v", script, i.id, err)
	}
	return stdout.String(), stderr.String(), end.GetExitCode()
}

func mustSh(t testing.TB, i *Instance, script string) string {
	t.Helper()
	out, errOut, code := sh(t, i, script)
	if code != 0 {
		t.Fatalf("%s: %q exited %d: %s%s", i.id, script, code, out, errOut)
	}
	return out
}

// assertClean checks the host holds nothing of this backend: QEMU processes, mounts,
// sandbox directories, RAM files, netns, veths.
func assertClean(t testing.TB, b *Backend) {
	t.Helper()
	if left := qemusUnder(b.cfg.DataDir); len(left) > 0 {
		t.Errorf("QEMU processes left: %v", left)
	}
	if m := mountsUnder(t, b.cfg.DataDir); len(m) > 0 {
		t.Errorf("mounts left: %v", m)
	}
	if ents, _ := os.ReadDir(b.cfg.sandboxesDir()); len(ents) > 0 {
		t.Errorf("sandbox directories left: %d", len(ents))
	}
	if ents, _ := os.ReadDir(b.cfg.RAMDir); len(ents) > 0 {
		t.Errorf("RAM files left: %d", len(ents))
	}
	ents, _ := os.ReadDir("/run/netns")
	for _, e := range ents {
		if strings.HasPrefix(e.Name(), b.cfg.Network.Prefix+"-") {
			t.Errorf("netns left: %s", e.Name())
		}
	}
	// A released slot's veth goes after the release (network.Pool.Settle).
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if err := b.pool.Settle(ctx); err != nil {
		t.Errorf("released slots' veths not gone: %v", err)
	}
	links, _ := netlink.LinkList()
	for _, l := range links {
		if strings.HasPrefix(l.Attrs().Name, b.cfg.Network.Prefix+"h") {
			t.Errorf("veth left: %s", l.Attrs().Name)
		}
	}
}

// qemusUnder lists the pids of processes whose command line mentions dir.
func qemusUnder(dir string) []string {
	var out []string
	procs, _ := filepath.Glob("/proc/[0-9]*/cmdline")
	for _, p := range procs {
		raw, err := os.ReadFile(p)
		if err == nil && bytes.Contains(raw, []byte(dir)) && bytes.Contains(raw, []byte("qemu")) {
			out = append(out, filepath.Base(filepath.Dir(p)))
		}
	}
	return out
}

func mountsUnder(t testing.TB, dir string) []string {
	raw, err := os.ReadFile("/proc/self/mountinfo")
	if err != nil {
		t.Fatal(err)
	}
	var out []string
	for _, l := range strings.Split(string(raw), "\n") {
		if strings.Contains(l, dir) {
			out = append(out, l)
		}
	}
	return out
}
