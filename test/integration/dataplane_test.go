package integration

import (
	"context"
	"encoding/json"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/aenv-dev/aenv/internal/bench"
	"github.com/aenv-dev/aenv/internal/dataplane"
)

// initPid is the host pid of the init of sandbox id's container (0 when none runs).
func (n *node) initPid(t testing.TB, id string) int {
	t.Helper()
	for cid, c := range runtimeList(t, n.dataDir) {
		raw, err := os.ReadFile(filepath.Join(n.dataDir, "oci", "sandboxes", cid, "state.json"))
		if err != nil {
			continue
		}
		var st struct {
			ID string `json:"id"`
		}
		if json.Unmarshal(raw, &st) == nil && st.ID == id && c.Status == "running" {
			return c.Pid
		}
	}
	return 0
}

// dataPlanePid is the pid of the node's data plane (0 when none answers).
func (n *node) dataPlanePid(t testing.TB) int {
	t.Helper()
	st, err := dataplane.NewClient(dataplane.SocketPath(filepath.Join(n.dataDir, "dataplane"))).Stats(context.Background())
	if err != nil {
		return 0
	}
	return st.PID
}

// stopDataPlane ends the node's data plane (with the node stopped, its disks closed) and
// removes its cgroup, as the node does at a shutdown that leaves no sandbox running.
func (n *node) stopDataPlane(t testing.TB) {
	t.Helper()
	if pid := n.dataPlanePid(t); pid > 0 {
		if err := dataplane.NewClient(dataplane.SocketPath(filepath.Join(n.dataDir, "dataplane"))).Shutdown(context.Background()); err != nil {
			t.Errorf("the data plane still runs after the node stopped: %v", err)
			syscall.Kill(pid, syscall.SIGKILL)
		}
		waitGone(pid)
	}
	dataplane.RemoveCgroup(dataplane.CgroupName(n.dataDir))
}

func waitGone(pid int) {
	for range 200 {
		if syscall.Kill(pid, 0) != nil {
			return
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// blockedTasks lists threads in state D (the hang a dead FUSE server leaves).
func blockedTasks() []string {
	stats, _ := filepath.Glob("/proc/[0-9]*/task/[0-9]*/stat")
	var out []string
	for _, p := range stats {
		raw, err := os.ReadFile(p)
		if err != nil {
			continue
		}
		s := string(raw)
		if i := strings.LastIndexByte(s, ')'); i > 0 && i+2 < len(s) && s[i+2] == 'D' {
			out = append(out, strings.TrimSpace(s[:i+1]))
		}
	}
	return out
}

// requireNoBlocked fails when threads stay in state D (a short one is the disk).
func requireNoBlocked(t *testing.T) {
	t.Helper()
	var left []string
	for range 20 {
		if left = blockedTasks(); len(left) == 0 {
			return
		}
		time.Sleep(100 * time.Millisecond)
	}
	t.Errorf("threads in state D: %v", left)
}

// survivor is a sandbox with a file written and a background process, checked across
// restarts of the node.
type survivor struct {
	sb  bench.Sandbox
	pid int // its init's host pid
	bg  string
}

func makeSurvivors(ctx context.Context, t *testing.T, n *node, c *bench.Client, count int) []survivor {
	t.Helper()
	out := make([]survivor, count)
	errs := make([]error, count)
	var wg sync.WaitGroup
	sem := make(chan struct{}, 4)
	for i := range out {
		wg.Add(1)
		sem <- struct{}{}
		go func() {
			defer func() { <-sem; wg.Done() }()
			// Longer than TestKillStorm's 20 minutes: on a loaded host the storm outlasts
			// 10, and a survivor its own timeout killed would read as one the node lost.
			sb, err := c.Create(ctx, bench.CreateRequest{TemplateID: "base-minimal", Timeout: 1800, Secure: true})
			if err != nil {
				errs[i] = err
				return
			}
			res, err := c.Run(ctx, sb, fmt.Sprintf("echo file-%d > /home/user/mark && sync && "+
				"(setsid sh -c 'echo $$ > /home/user/bg.pid; exec sleep 100000' </dev/null >/dev/null 2>&1 &) && "+
				"for i in $(seq 100); do [ -s /home/user/bg.pid ] && break; sleep 0.1; done; cat /home/user/bg.pid", i))
			if err == nil && res.ExitCode != 0 {
				err = fmt.Errorf("exit %d: %s%s", res.ExitCode, res.Stdout, res.Stderr)
			}
			out[i], errs[i] = survivor{sb: sb, bg: strings.TrimSpace(res.Stdout)}, err
		}()
	}
	wg.Wait()
	for i, err := range errs {
		if err != nil {
			t.Fatalf("survivor %d: %v", i, err)
		}
	}
	n.observe()
	for i := range out {
		out[i].pid = n.initPid(t, out[i].sb.ID)
	}
	return out
}

// checkSurvivors checks every survivor runs on: same init, same background process, its
// file, and a root it can write.
func checkSurvivors(ctx context.Context, t *testing.T, n *node, c *bench.Client, ss []survivor) {
	t.Helper()
	got := states(ctx, t, c)
	for i, s := range ss {
		if got[s.sb.ID] != "running" {
			t.Errorf("sandbox %s is %q after the restart", s.sb.ID, got[s.sb.ID])
			continue
		}
		if pid := n.initPid(t, s.sb.ID); pid != s.pid {
			t.Errorf("sandbox %s: init pid %d, was %d", s.sb.ID, pid, s.pid)
		}
		out := run(ctx, t, c, s.sb, fmt.Sprintf("cat /home/user/mark; kill -0 $(cat /home/user/bg.pid) && cat /home/user/bg.pid; echo w-%d > /home/user/w && cat /home/user/w", i))
		if want := fmt.Sprintf("file-%d\n%s\nw-%d", i, s.bg, i); out != want {
			t.Errorf("sandbox %s reads %q, want %q", s.sb.ID, out, want)
		}
	}
}

// TestLayeredSandboxesSurviveNodeKill runs sandboxes on the layered base with files and
// background processes, kills the node with SIGKILL (idle, and again in the middle of a
// burst of creates), and checks each restart adopts every one of them: same init and
// background process, files intact, writable; the creates the crash interrupted leave
// nothing; no thread is left in state D. Then everything is killed through the API and
// nothing is left on the host: containers, mounts, loop devices, network namespaces,
// cgroups, FUSE connections, the data plane.
func TestLayeredSandboxesSurviveNodeKill(t *testing.T) {
	const count = 8
	n := newNode(t, "AENV_SANDBOX_SHUTDOWN_ACTION=stop")
	n.start()
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	c := n.client()
	ss := makeSurvivors(ctx, t, n, c, count)
	if len(loopDevices(n.dataDir)) == 0 {
		t.Skip("the base template is not layered on this host: no sandbox runs on a block root")
	}
	n.observe()
	dpPid := n.dataPlanePid(t)
	if dpPid == 0 {
		t.Fatal("no data plane answers")
	}

	n.kill9()
	start := time.Now()
	n.start()
	t.Logf("restart with %d sandboxes: answering after %v", count, time.Since(start).Round(time.Millisecond))
	checkSurvivors(ctx, t, n, c, ss)
	if pid := n.dataPlanePid(t); pid != dpPid {
		t.Errorf("the data plane is pid %d after the restart, was %d", pid, dpPid)
	}

	// A kill in the middle of a burst of creates.
	burst := make(chan struct{})
	go func() {
		defer close(burst)
		var wg sync.WaitGroup
		for range 6 {
			wg.Add(1)
			go func() {
				defer wg.Done()
				_, _ = c.Create(ctx, bench.CreateRequest{TemplateID: "base-minimal", Timeout: 600, Secure: true})
			}()
		}
		wg.Wait()
	}()
	time.Sleep(150 * time.Millisecond)
	n.observe()
	n.kill9()
	<-burst
	n.start()
	checkSurvivors(ctx, t, n, c, ss)
	requireNoBlocked(t)

	// An upgrade: another build of aenv replaces the binary and the node restarts. The
	// data plane of the old build keeps serving (same API version) and the new node adopts.
	n.bins.aenv = buildVersioned(t, "it-upgrade")
	n.kill9()
	n.start()
	checkSurvivors(ctx, t, n, c, ss)
	if pid := n.dataPlanePid(t); pid != dpPid {
		t.Errorf("the data plane is pid %d after the upgrade, was %d", pid, dpPid)
	}
	if !strings.Contains(n.output(), "aenv serving") || strings.Count(n.output(), "msg=\"data plane\" started=false") < 3 {
		t.Errorf("the upgraded node did not report the running data plane")
	}

	killAll(ctx, t, c)
	n.stop()
	if pid := n.dataPlanePid(t); pid != 0 {
		t.Errorf("the idle data plane (pid %d) still runs after the node stopped", pid)
		n.stopDataPlane(t)
	}
	requireNoLeftovers(t, n, nil)
	requireNoStateLeftovers(t, n)
	for _, d := range dataplane.CgroupDirs(dataplane.CgroupName(n.dataDir)) {
		if _, err := os.Stat(d); err == nil {
			t.Errorf("the data plane's cgroup %s is left", d)
		}
	}
}

// TestDataPlaneKill kills the data plane itself (SIGKILL) under running sandboxes and
// checks the documented outcome: the node reports each of them lost and removes it (no
// thread waits on the dead disks, nothing is left of them), starts a new data plane, and
// new sandboxes work; a sandbox that was paused to disk resumes with its files.
func TestDataPlaneKill(t *testing.T) {
	n := newNode(t, "AENV_SANDBOX_SHUTDOWN_ACTION=stop")
	n.start()
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	c := n.client()
	ss := makeSurvivors(ctx, t, n, c, 3)
	paused := n.create(ctx, c)
	run(ctx, t, c, paused, "echo kept > /home/user/mark")
	if err := c.PauseToDisk(ctx, paused.ID); err != nil {
		skipIfNotLayered(t, err)
		t.Fatal(err)
	}
	// A writer that is busy when the disk dies.
	go func() { _, _ = c.Run(ctx, ss[0].sb, "while :; do echo x >> /home/user/log; done") }()
	time.Sleep(200 * time.Millisecond)
	n.observe()
	dpPid := n.dataPlanePid(t)
	if err := syscall.Kill(dpPid, syscall.SIGKILL); err != nil {
		t.Fatal(err)
	}
	deadline := time.Now().Add(30 * time.Second)
	for {
		got := states(ctx, t, c)
		if len(got) == 1 && got[paused.ID] == "paused" {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("after the data plane died the node lists %v, want only the paused sandbox", got)
		}
		time.Sleep(100 * time.Millisecond)
	}
	if !strings.Contains(n.output(), "the data plane is gone; the sandboxes whose root disks it served are lost") {
		t.Error("the node did not report the lost sandboxes")
	}
	requireNoBlocked(t)
	if !waitFor(15*time.Second, func() bool { pid := n.dataPlanePid(t); return pid != 0 && pid != dpPid }) {
		t.Errorf("no new data plane after the old one (pid %d) died", dpPid)
	}
	fresh := n.create(ctx, c)
	if out := run(ctx, t, c, fresh, "echo ok > /home/user/f && cat /home/user/f"); out != "ok" {
		t.Errorf("a sandbox created after the data plane died reads %q", out)
	}
	if _, err := c.Connect(ctx, paused.ID, 300); err != nil {
		t.Fatalf("resume the sandbox paused to disk: %v", err)
	}
	if out := run(ctx, t, c, paused, "cat /home/user/mark"); out != "kept" {
		t.Errorf("resumed sandbox reads %q", out)
	}
	killAll(ctx, t, c)
	n.stop()
	requireNoLeftovers(t, n, nil)
}

// TestSystemdUnit checks deploy/systemd/aenv.service: KillMode=process (the data plane and
// the sandboxes survive a service restart), no mount namespacing, and systemd-analyze
// verify accepts it (with ExecStart pointed at the binary under test).
func TestSystemdUnit(t *testing.T) {
	root, err := repoRoot()
	if err != nil {
		t.Fatal(err)
	}
	raw, err := os.ReadFile(filepath.Join(root, "deploy", "systemd", "aenv.service"))
	if err != nil {
		t.Fatal(err)
	}
	unit := string(raw)
	settings := map[string]string{}
	for _, line := range strings.Split(unit, "\n") {
		if k, v, ok := strings.Cut(line, "="); ok && !strings.HasPrefix(line, "#") {
			settings[strings.TrimSpace(k)] = strings.TrimSpace(v)
		}
	}
	if settings["KillMode"] != "process" {
		t.Errorf("KillMode=%q, want process", settings["KillMode"])
	}
	for _, k := range []string{"PrivateTmp", "ProtectSystem", "ProtectHome", "PrivateMounts", "ReadWritePaths"} {
		if _, ok := settings[k]; ok {
			t.Errorf("%s isolates the node's mounts from the next start's", k)
		}
	}
	if !strings.HasPrefix(settings["ExecStart"], "/usr/local/bin/aenv serve") {
		t.Errorf("ExecStart=%q", settings["ExecStart"])
	}
	sa, err := exec.LookPath("systemd-analyze")
	if err != nil {
		t.Skip("systemd-analyze not installed: the unit's keys were checked, not verified")
	}
	b := needNode(t)
	dir := t.TempDir()
	p := filepath.Join(dir, "aenv.service")
	if err := os.WriteFile(p, []byte(strings.ReplaceAll(unit, "/usr/local/bin/aenv", b.aenv)), 0o644); err != nil {
		t.Fatal(err)
	}
	out, err := exec.Command(sa, "verify", p).CombinedOutput()
	if err != nil || strings.Contains(string(out), "aenv.service:") {
		t.Errorf("systemd-analyze verify: %v: %s", err, out)
	}
}

// removeDataPlaneCgroup removes the cgroup of the data plane of dataDir once its process
// (killed by forceCleanup) has left it.
func removeDataPlaneCgroup(dataDir string) {
	name := dataplane.CgroupName(dataDir)
	for range 100 {
		dataplane.RemoveCgroup(name)
		left := false
		for _, d := range dataplane.CgroupDirs(name) {
			if _, err := os.Stat(d); err == nil {
				left = true
			}
		}
		if !left {
			return
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// buildVersioned builds aenv from this checkout with main.version set, as an upgrade
// would bring.
func buildVersioned(t *testing.T, version string) string {
	t.Helper()
	root, err := repoRoot()
	if err != nil {
		t.Fatal(err)
	}
	out := filepath.Join(t.TempDir(), "aenv")
	cmd := exec.Command("go", "build", "-trimpath", "-ldflags", "-X main.version="+version, "-o", out, "./cmd/aenv")
	cmd.Dir = root
	cmd.Env = append(os.Environ(), "CGO_ENABLED=0")
	if b, err := cmd.CombinedOutput(); err != nil {
		t.Fatalf("build aenv %s: %v: %s", version, err, b)
	}
	// Sandbox roots do not need it, but the node copies nothing from next to it either.
	_ = os.Chmod(filepath.Dir(out), 0o755)
	return out
}

// TestFailedStartStopsDataPlane: a node whose start fails after it started the data plane
// (here: the OCI runtime it is given cannot start a container, as on a host where none
// works) leaves no data plane running and no FUSE mount behind, as a node stopped with no
// sandbox does; before, `aenv dataplane` ran on, holding its mount.
func TestFailedStartStopsDataPlane(t *testing.T) {
	runtime := filepath.Join(t.TempDir(), "runc")
	if err := os.WriteFile(runtime, []byte("#!/bin/sh\necho 'this runtime starts nothing' >&2\nexit 1\n"), 0o755); err != nil {
		t.Fatal(err)
	}
	n := newNode(t, "AENV_BACKEND_RUNTIME="+runtime)
	n.launch()
	select {
	case <-n.done:
	case <-time.After(60 * time.Second):
		t.Fatalf("aenv serve with a runtime that starts nothing still runs after 60 s:\n%s", n.output())
	}
	if n.cmd.ProcessState.Success() || !strings.Contains(n.output(), "this runtime starts nothing") {
		t.Fatalf("aenv serve with a runtime that starts nothing: %v\n%s", n.cmd.ProcessState, n.output())
	}
	if !strings.Contains(n.output(), "data plane") {
		t.Fatalf("the node failed before it started the data plane, so this shows nothing:\n%s", n.output())
	}
	if pid := n.dataPlanePid(t); pid != 0 {
		t.Errorf("the data plane (pid %d) still runs after the node failed to start", pid)
	}
	if m := mountsUnder(t, n.dataDir); len(m) > 0 {
		t.Errorf("mounts left under the data dir: %v", m)
	}
}
