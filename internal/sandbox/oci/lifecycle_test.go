package oci

import (
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/aenv-dev/aenv/internal/sandbox"
)

func TestLaunchReachStop(t *testing.T) {
	for _, mode := range []string{UserNSAuto, UserNSOff} {
		t.Run("userns="+mode, func(t *testing.T) { testLaunchReachStop(t, mode) })
	}
}

func testLaunchReachStop(t *testing.T, mode string) {
	e := newTestBackend(t, func(c *Config) { c.UserNamespace = mode })
	if mode == UserNSOff && e.b.UserNamespaces() {
		t.Fatal("UserNamespace=off but the backend uses one")
	}
	ctx := context.Background()
	i := e.launch(t, "life1", sandbox.Resources{CPUCount: 1, MemoryMB: 128, DiskSizeMB: 512})
	t.Logf("runtime=%s userns=%v ip=%s", e.b.Runtime(), e.b.UserNamespaces(), i.Endpoint().Host)

	out, code := e.sh(t, i, "/bin/bash -l -c 'id -u; echo $PATH; test -x /.aenv/envd && echo envd-present; cat /proc/1/cmdline | tr \"\\0\" \" \"'")
	if code != 0 || !strings.HasPrefix(out, "0\n/usr/local/sbin:") || !strings.Contains(out, "envd-present") {
		t.Fatalf("exec: code %d out %q", code, out)
	}
	if want := e.b.cfg.ResolvConf; want != "" {
		host, _ := os.ReadFile(want)
		if out, _ := e.sh(t, i, "cat /etc/resolv.conf"); out != string(host) {
			t.Fatalf("resolv.conf %q, want the host's %q", out, host)
		}
	}
	st, err := i.Stats(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if st.MemUsed <= 0 || st.MemTotal != 128<<20 || st.CPUCount != 1 || st.DiskTotal != 512<<20 || st.DiskUsed <= 0 {
		t.Fatalf("stats %+v", st)
	}
	slot := traceSlot(t, i.slot)
	if err := i.Stop(ctx); err != nil {
		t.Fatal(err)
	}
	if err := i.Stop(ctx); err != nil {
		t.Fatalf("second stop: %v", err)
	}
	if _, err := i.Stats(ctx); !errors.Is(err, sandbox.ErrGone) {
		t.Fatalf("stats after stop: %v", err)
	}
	assertGone(t, e.b, i.cid, slot)
}

// TestRealEnvd runs the repository's envd as init and reaches it from the host.
func TestRealEnvd(t *testing.T) {
	needRuntime(t)
	envd := testEnvd(t)
	if envd == "" {
		t.Skip("cmd/envd does not build or does not answer --help yet")
	}
	e := newTestBackend(t, func(c *Config) { c.EnvdPath, c.InitArgs = envd, nil })
	i := e.launch(t, "envd1", sandbox.Resources{CPUCount: 1, MemoryMB: 256})
	if err := probeHealth(i, time.Second); err != nil {
		t.Fatal(err)
	}
}

// TestConcurrentLaunchStop launches and stops sandboxes from many goroutines at once, as
// a fork fan-out or a burst of creates does.
func TestConcurrentLaunchStop(t *testing.T) {
	for _, warm := range []int{-1, 3} {
		t.Run(fmt.Sprintf("warm=%d", max(warm, 0)), func(t *testing.T) { testConcurrentLaunchStop(t, warm) })
	}
}

func testConcurrentLaunchStop(t *testing.T, warm int) {
	e := newTestBackend(t, func(c *Config) { c.WarmContainers = warm })
	if warm > 0 {
		e.launch(t, "conc-prime", sandbox.Resources{}) // makes the template wanted
		waitWarm(t, e.b, e.template, warm)
	}
	const n = 8
	insts := make([]*Instance, n)
	errs := make(chan error, n)
	for k := 0; k < n; k++ {
		go func() {
			inst, err := e.b.Launch(context.Background(), sandbox.LaunchPlan{
				Kind: sandbox.LaunchFresh, SandboxID: fmt.Sprintf("conc%d", k),
				RootFS: sandbox.RootFS{LowerDir: e.template}, Resources: sandbox.Resources{CPUCount: 1, MemoryMB: 64},
			})
			if err == nil {
				insts[k] = inst.(*Instance)
			}
			errs <- err
		}()
	}
	for k := 0; k < n; k++ {
		if err := <-errs; err != nil {
			t.Fatal(err)
		}
	}
	ips := map[string]bool{}
	for _, i := range insts {
		e.waitReady(t, i)
		ips[i.Endpoint().Host] = true
	}
	if len(ips) != n {
		t.Fatalf("%d distinct addresses for %d sandboxes", len(ips), n)
	}
	for _, i := range insts {
		go func() {
			slot := traceSlot(t, i.slot)
			err := i.Stop(context.Background())
			if err == nil {
				assertGone(t, e.b, i.cid, slot)
			}
			errs <- err
		}()
	}
	for k := 0; k < n; k++ {
		if err := <-errs; err != nil {
			t.Fatal(err)
		}
	}
}

// TestWarmContainers launches from the warm pool: the sandbox must get its own limits,
// hostname, network policy and state, and stop as cleanly as a fresh one.
func TestWarmContainers(t *testing.T) { eachRuntime(t, testWarmContainers) }

func testWarmContainers(t *testing.T, runtime string) {
	e := newTestBackend(t, func(c *Config) { c.WarmContainers, c.Runtime = 2, runtime })
	ctx := context.Background()
	first := e.launch(t, "warm0", sandbox.Resources{CPUCount: 1, MemoryMB: 64})
	if first.cid != "warm0" {
		t.Fatalf("first launch of a template used warm container %s", first.cid)
	}
	waitWarm(t, e.b, e.template, 2)

	inst, err := e.b.Launch(ctx, sandbox.LaunchPlan{
		Kind: sandbox.LaunchFresh, SandboxID: "warm1", RootFS: sandbox.RootFS{LowerDir: e.template},
		Resources: sandbox.Resources{CPUCount: 2, MemoryMB: 96}, AllowInternet: false,
	})
	if err != nil {
		t.Fatal(err)
	}
	i := inst.(*Instance)
	if i.cid == "warm1" || !strings.HasPrefix(i.cid, "warm.") {
		t.Fatalf("second launch did not use a warm container (cid %s)", i.cid)
	}
	e.waitReady(t, i)
	out, code := e.sh(t, i, "hostname; cat /sys/fs/cgroup/memory/memory.limit_in_bytes 2>/dev/null || cat /sys/fs/cgroup/memory.max")
	if code != 0 || out != fmt.Sprintf("warm1\n%d\n", 96<<20) {
		t.Fatalf("hostname/limit inside: %q", out)
	}
	if st, err := i.Stats(ctx); err != nil || st.MemTotal != 96<<20 || st.CPUCount != 2 {
		t.Fatalf("stats %+v %v", st, err)
	}
	nft, _ := exec.Command("nft", "list", "set", "inet", testBridge, "blocked").CombinedOutput()
	if !strings.Contains(string(nft), i.Endpoint().Host) {
		t.Fatalf("AllowInternet=false not applied to the warm slot: %s", nft)
	}
	st, err := readState(i.l.state())
	if err != nil || st.ID != "warm1" || st.ContainerID != i.cid || st.AllowInternet {
		t.Fatalf("saved state %+v %v", st, err)
	}
	slot := traceSlot(t, i.slot)
	if err := i.Stop(ctx); err != nil {
		t.Fatal(err)
	}
	assertGone(t, e.b, i.cid, slot)
	// Close removes the warm containers (checked by the cleanup's assertClean).
	if err := e.b.Close(ctx); err != nil {
		t.Fatal(err)
	}
	cs, _ := e.b.rt.list(ctx)
	for _, c := range cs {
		if strings.HasPrefix(c.ID, "warm.") {
			t.Fatalf("warm container %s left after Close", c.ID)
		}
	}
}

func waitWarm(t *testing.T, b *Backend, lower string, n int) {
	t.Helper()
	deadline := time.Now().Add(20 * time.Second)
	for {
		b.warm.mu.Lock()
		got := len(b.warm.ready[lower])
		b.warm.mu.Unlock()
		if got >= n {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("%d of %d warm containers after 20s", got, n)
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// TestWarmContainerDiedInPool: warm containers run their init while they wait in the
// pool; one whose init died there is not handed out, the launch gets a fresh container.
func TestWarmContainerDiedInPool(t *testing.T) {
	e := newTestBackend(t, func(c *Config) { c.WarmContainers = 1 })
	e.launch(t, "wd0", sandbox.Resources{})
	waitWarm(t, e.b, e.template, 1)
	e.b.warm.mu.Lock()
	w := e.b.warm.ready[e.template][0]
	e.b.warm.mu.Unlock()
	if !w.running {
		t.Fatalf("warm container %s in the pool without its init started", w.cid)
	}
	raw, err := os.ReadFile(w.l.pid())
	if err != nil {
		t.Fatal(err)
	}
	pid, err := strconv.Atoi(strings.TrimSpace(string(raw)))
	if err != nil {
		t.Fatal(err)
	}
	if !e.b.initAlive(w.cid, pid) {
		t.Fatalf("init %d of warm container %s not seen alive", pid, w.cid)
	}
	if err := syscall.Kill(pid, syscall.SIGKILL); err != nil {
		t.Fatal(err)
	}
	deadline := time.Now().Add(10 * time.Second)
	for e.b.initAlive(w.cid, pid) {
		if time.Now().After(deadline) {
			t.Fatalf("init %d still alive 10s after SIGKILL", pid)
		}
		time.Sleep(5 * time.Millisecond)
	}
	i := e.launch(t, "wd1", sandbox.Resources{})
	if i.cid == w.cid {
		t.Fatalf("launch was handed warm container %s, whose init is dead", w.cid)
	}
	if out, code := e.sh(t, i, "hostname"); code != 0 || out != "wd1\n" {
		t.Fatalf("hostname inside: %q (exit %d)", out, code)
	}
}
