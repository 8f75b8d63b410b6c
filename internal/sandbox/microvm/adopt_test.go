package microvm

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"math/rand/v2"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/aenv-dev/aenv/internal/dataplane"
	"github.com/aenv-dev/aenv/internal/envdclient"
	"github.com/aenv-dev/aenv/internal/sandbox"
)

// The node-crash tests: a child process (this test binary) is the node. It runs the
// backend on a data plane that is another child (`aenv dataplane`'s Run), launches or
// adopts VMs, reports them, then does something (a snapshot, a pause, a fork, a burst)
// and is killed with SIGKILL in the middle: by a crash point, or by the test at a random
// moment. The next node (another child, or the test itself) must adopt every VM with the
// same QEMU and the same guest processes, and leave nothing else behind.

const (
	// adoptChildEnv makes the test binary a node (adoptChild).
	adoptChildEnv = "AENV_MICROVM_ADOPT_CHILD"
	// dataPlaneChildEnv makes the test binary a data plane serving the directory named.
	dataPlaneChildEnv = "AENV_MICROVM_DATAPLANE_CHILD"
)

type adoptSpec struct {
	Config   Config         `json:"config"`
	Socket   string         `json:"socket"` // the data plane's
	Template sandbox.RootFS `json:"template"`
	IDs      []string       `json:"ids"`
	// Action after the VMs are adopted (or launched): "" (wait), "snapshot", "pause",
	// "fork" or "burst".
	Action string `json:"action"`
}

// vmReport is what a node child says about one VM.
type vmReport struct {
	ID      string `json:"id"`
	QEMU    int    `json:"qemu"`
	Addr    string `json:"addr"` // envd
	Counter string `json:"counter"`
	Value   int    `json:"value"`
}

func dataPlaneChild(dir string) error {
	return dataplane.Run(context.Background(), dir, "test", slog.New(slog.NewTextHandler(os.Stderr, nil)))
}

func adoptChild(raw string) error {
	var spec adoptSpec
	if err := json.Unmarshal([]byte(raw), &spec); err != nil {
		return err
	}
	ctx := context.Background()
	spec.Config.DataPlane = dataplane.NewClient(spec.Socket)
	b, err := New(ctx, spec.Config)
	if err != nil {
		return err
	}
	alive, err := b.Reconcile(ctx, spec.IDs)
	if err != nil {
		return err
	}
	if err := b.ReconcileCaptures(ctx, nil); err != nil {
		return err
	}
	var reports []vmReport
	insts := map[string]*Instance{}
	for _, id := range spec.IDs {
		inst, ok := alive[id].(*Instance)
		if !ok {
			launched, err := b.Launch(ctx, sandbox.LaunchPlan{Kind: sandbox.LaunchFresh, SandboxID: id, RootFS: spec.Template, AllowInternet: true})
			if err != nil {
				return err
			}
			inst = launched.(*Instance)
			if err := envdReady(inst, 90*time.Second); err != nil {
				return err
			}
			if _, err := shErr(inst, counterScript); err != nil {
				return err
			}
		}
		insts[id] = inst
		r, err := report(inst)
		if err != nil {
			return fmt.Errorf("%s: %w", id, err)
		}
		reports = append(reports, r)
	}
	line, _ := json.Marshal(reports)
	fmt.Printf("READY %s\n", line)
	return childAction(ctx, b, spec, insts)
}

// childAction does the spec's action; a crash point or the test's SIGKILL ends it.
func childAction(ctx context.Context, b *Backend, spec adoptSpec, insts map[string]*Instance) error {
	first := insts[spec.IDs[0]]
	switch spec.Action {
	case "snapshot":
		_, err := first.Snapshot(ctx)
		return fmt.Errorf("snapshot returned (%v): the crash point was not reached", err)
	case "pause":
		_, err := first.Pause(ctx, sandbox.PauseOptions{})
		return fmt.Errorf("pause returned (%v): the crash point was not reached", err)
	case "fork":
		_, err := first.Fork(ctx, []sandbox.ForkSpec{{SandboxID: "fork-a"}, {SandboxID: "fork-b"}})
		return fmt.Errorf("fork returned (%v): the crash point was not reached", err)
	case "burst":
		// Until killed: snapshots of one VM, forks of another (children stopped again),
		// fresh launches and stops.
		var wg sync.WaitGroup
		loop := func(f func(n int)) {
			wg.Add(1)
			go func() {
				defer wg.Done()
				for n := 0; ; n++ {
					f(n)
				}
			}()
		}
		loop(func(int) {
			// Discarded at once: each image is a copy of the guest's RAM in tmpfs.
			if c, err := first.Snapshot(ctx); err == nil {
				_ = b.DiscardSnapshot(ctx, c)
			}
		})
		loop(func(n int) {
			res, _ := insts[spec.IDs[1]].Fork(ctx, []sandbox.ForkSpec{{SandboxID: fmt.Sprintf("bfork-%d", n)}})
			for _, r := range res {
				if r.Err == nil {
					_ = r.Instance.Stop(ctx)
				}
			}
		})
		loop(func(n int) {
			i, err := b.Launch(ctx, sandbox.LaunchPlan{Kind: sandbox.LaunchFresh, SandboxID: fmt.Sprintf("extra-%d", n), RootFS: spec.Template})
			if err == nil {
				time.Sleep(200 * time.Millisecond)
				_ = i.Stop(ctx)
			}
		})
		wg.Wait()
	}
	select {}
}

// report describes a VM and its counter process.
func report(i *Instance) (vmReport, error) {
	var f []string
	// The counter rewrites its file: a read may find it empty.
	for try := 0; try < 20 && len(f) != 3; try++ {
		out, err := shErr(i, `p=$(cat /tmp/counter.pid); echo $p; if kill -0 $p 2>/dev/null; then echo yes; else echo no; fi; cat /tmp/count`)
		if err != nil {
			return vmReport{}, err
		}
		f = strings.Fields(out)
	}
	if len(f) != 3 || f[1] != "yes" {
		return vmReport{}, fmt.Errorf("counter state %q", f)
	}
	v, err := strconv.Atoi(f[2])
	if err != nil {
		return vmReport{}, err
	}
	ep := i.Endpoint()
	return vmReport{ID: i.id, QEMU: i.PID(), Addr: fmt.Sprintf("%s:%d", ep.Host, ep.EnvdPort), Counter: f[0], Value: v}, nil
}

// shErr runs a bash script in the VM through envd and returns its stdout.
func shErr(i *Instance, script string) (string, error) {
	ep := i.Endpoint()
	c := envdclient.New(http.DefaultClient, fmt.Sprintf("http://%s:%d", ep.Host, ep.EnvdPort))
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	p, err := c.Start(ctx, envdclient.Command{Cmd: "/bin/bash", Args: []string{"-c", script}})
	if err != nil {
		return "", err
	}
	defer p.Close()
	var stdout, stderr bytes.Buffer
	end, err := p.Wait(&stdout, &stderr)
	if err != nil {
		return "", err
	}
	if end.GetExitCode() != 0 {
		return "", fmt.Errorf("%q exited %d: %s", script, end.GetExitCode(), stderr.String())
	}
	return stdout.String(), nil
}

// startTestDataPlane runs a data plane (a child process in a session of its own, as the
// node starts it) for the test's life.
func startTestDataPlane(t *testing.T) string {
	dir := filepath.Join(t.TempDir(), "dataplane")
	c, _, err := dataplane.Ensure(context.Background(), dataplane.StartOptions{Dir: dir,
		Command: []string{"/usr/bin/env", dataPlaneChildEnv + "=" + dir, os.Args[0], "-test.run=^$"}})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		ctx := context.Background()
		if disks, err := c.List(ctx); err != nil || len(disks) > 0 {
			t.Errorf("data plane still serves %d disks (%v)", len(disks), err)
		}
		if err := c.Shutdown(ctx); err != nil {
			t.Errorf("data plane shutdown: %v", err)
		}
		for range 200 {
			if c.Ping(ctx) != nil {
				return
			}
			time.Sleep(10 * time.Millisecond)
		}
		t.Error("data plane did not exit")
	})
	return dataplane.SocketPath(dir)
}

// runNode starts a node child and returns its report once it is ready; kill ends it.
func runNode(t *testing.T, spec adoptSpec, crashAt string) (reports []vmReport, wait func() error, kill func()) {
	t.Helper()
	raw, err := json.Marshal(spec)
	if err != nil {
		t.Fatal(err)
	}
	child := exec.Command(os.Args[0], "-test.run=^$")
	child.Env = append(os.Environ(), adoptChildEnv+"="+string(raw))
	if crashAt != "" {
		child.Env = append(child.Env, CrashPointEnv+"="+crashAt)
	}
	child.Stderr = os.Stderr
	out, err := child.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := child.Start(); err != nil {
		t.Fatal(err)
	}
	kill = func() { _ = child.Process.Kill() }
	line, err := bufio.NewReader(out).ReadString('\n')
	rest, ok := strings.CutPrefix(line, "READY ")
	if err != nil || !ok || json.Unmarshal([]byte(rest), &reports) != nil {
		kill()
		child.Wait()
		t.Fatalf("node child: %q %v", line, err)
	}
	return reports, child.Wait, kill
}

// checkSame compares two reports of the same VMs: same QEMU, same counter process, which
// went on counting.
func checkSame(t *testing.T, round string, before, after []vmReport) {
	t.Helper()
	if len(before) != len(after) {
		t.Fatalf("%s: %d VMs before, %d after", round, len(before), len(after))
	}
	for n := range before {
		b, a := before[n], after[n]
		if a.ID != b.ID || a.QEMU != b.QEMU || a.Addr != b.Addr || a.Counter != b.Counter || a.Value <= b.Value {
			t.Errorf("%s: VM %s was %+v, after the restart %+v (want the same QEMU, address and counter process, counting on)", round, b.ID, b, a)
		}
	}
}

// TestNodeKillAdoptsVMs is the node-crash test: 3 VMs on a data plane, the node killed
// with SIGKILL at each capture crash point (mid-snapshot before and after the disk seal,
// a pause whose RAM file had moved into its capture, a fork with its first child up) and
// at random moments of bursts of snapshots, forks and launches; each next node adopts the
// 3 VMs (same QEMU processes, same guest processes) and removes what the crash left: fork
// children, half-launched VMs, unregistered captures. The test itself is the last node:
// it checks nothing is left but the 3 VMs, then stops them and checks the host is clean.
func TestNodeKillAdoptsVMs(t *testing.T) {
	needVM(t)
	fixtures(t)
	cfg := testConfig(t)
	spec := adoptSpec{Config: cfg, Socket: startTestDataPlane(t), Template: fix.template, IDs: []string{"vm-a", "vm-b", "vm-c"}}
	// Whatever a failure leaves (VMs, disks, slots) goes before the data plane stops.
	t.Cleanup(func() { sweepAll(t, spec) })
	t0 := time.Now()
	first, wait, kill := runNode(t, spec, "")
	t.Logf("3 VMs launched in %v", time.Since(t0).Round(time.Millisecond))
	prev := first
	rounds := []struct{ action, crashAt string }{
		{"snapshot", crashCaptureState},
		{"snapshot", crashCaptureSealed},
		{"pause", crashCaptureRAM},
		{"fork", crashForkLaunched},
		{"burst", ""}, {"burst", ""}, {"burst", ""},
	}
	for n, r := range rounds {
		kill()
		_ = wait()
		spec.Action = r.action
		t0 := time.Now()
		var reports []vmReport
		reports, wait, kill = runNode(t, spec, r.crashAt)
		round := fmt.Sprintf("round %d (%s %s)", n, r.action, r.crashAt)
		t.Logf("%s: the next node adopted the 3 VMs and reported them in %v", round, time.Since(t0).Round(time.Millisecond))
		checkSame(t, round, prev, reports)
		prev = reports
		if r.crashAt != "" {
			// The crash point kills the node.
			if err := wait(); !isKilled(err) {
				t.Fatalf("%s: node ended with %v, not SIGKILL", round, err)
			}
			wait = func() error { return nil }
		} else {
			time.Sleep(time.Duration(500+rand.IntN(2500)) * time.Millisecond)
		}
	}
	if n := len(rounds); n > 0 && rounds[n-1].crashAt == "" {
		kill()
		_ = wait()
	}
	lastNode(t, spec, prev)
}

// lastNode is the last node: the test adopts the VMs itself and checks the host.
func lastNode(t *testing.T, spec adoptSpec, prev []vmReport) {
	t.Helper()
	ctx := context.Background()
	cfg := spec.Config
	cfg.DataPlane = dataplane.NewClient(spec.Socket)
	b, err := New(ctx, cfg)
	if err != nil {
		t.Fatal(err)
	}
	t0 := time.Now()
	alive, err := b.Reconcile(ctx, spec.IDs)
	if err != nil {
		t.Fatal(err)
	}
	adoptTime := time.Since(t0)
	for id, inst := range alive {
		if err := envdReady(inst.(*Instance), 30*time.Second); err != nil {
			t.Errorf("adopted %s: envd: %v", id, err)
		}
	}
	answerTime := time.Since(t0)
	if err := b.ReconcileCaptures(ctx, nil); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		for _, inst := range alive {
			if err := inst.Stop(ctx); err != nil {
				t.Errorf("stop %s: %v", inst.ID(), err)
			}
		}
		if err := b.pool.Teardown(ctx); err != nil {
			t.Error(err)
		}
		assertClean(t, b)
		if ents, _ := os.ReadDir(b.cfg.imagesDir()); len(ents) > 0 {
			t.Errorf("memory images left: %d", len(ents))
		}
	})
	var reports []vmReport
	for _, id := range spec.IDs {
		inst, ok := alive[id].(*Instance)
		if !ok {
			t.Fatalf("%s not adopted", id)
		}
		r, err := report(inst)
		if err != nil {
			t.Fatalf("%s: %v", id, err)
		}
		reports = append(reports, r)
	}
	t.Logf("last restart: Reconcile adopted %d VMs in %v, all envd answering after %v", len(alive),
		adoptTime.Round(time.Millisecond), answerTime.Round(time.Millisecond))
	checkSame(t, "last restart", prev, reports)
	if q := qemusUnder(cfg.DataDir); len(q) != len(spec.IDs) {
		t.Errorf("QEMU processes: %v, want only the %d adopted", q, len(spec.IDs))
	}
	if ents, _ := os.ReadDir(b.cfg.sandboxesDir()); len(ents) != len(spec.IDs) {
		t.Errorf("%d sandbox directories, want %d", len(ents), len(spec.IDs))
	}
	if ents, _ := os.ReadDir(b.cfg.imagesDir()); len(ents) > 0 {
		t.Errorf("%d unregistered memory images left", len(ents))
	}
	disks, err := cfg.DataPlane.List(ctx)
	if err != nil || len(disks) != len(spec.IDs) {
		t.Errorf("the data plane serves %d disks (%v), want %d", len(disks), err, len(spec.IDs))
	}
	// Captures left are the sealed layers the adopted disks run on, nothing else.
	lowers, lowerPaths := map[string]bool{}, map[string]bool{}
	for _, inst := range alive {
		for _, l := range inst.(*Instance).disk.Lowers() {
			lowers[filepath.Base(filepath.Dir(l.Path))] = true
			lowerPaths[l.Path] = true
		}
	}
	ents, _ := os.ReadDir(b.cfg.capturesDir())
	for _, e := range ents {
		if !lowers[e.Name()] {
			t.Errorf("capture %s left, and no adopted disk runs on it", e.Name())
			continue
		}
		files, _ := os.ReadDir(filepath.Join(b.cfg.capturesDir(), e.Name()))
		for _, f := range files {
			if p := filepath.Join(b.cfg.capturesDir(), e.Name(), f.Name()); !lowerPaths[p] {
				t.Errorf("unregistered capture file left beside a running disk's layer: %s", p)
			}
		}
	}
}

func isKilled(err error) bool {
	var ee *exec.ExitError
	if !errors.As(err, &ee) {
		return false
	}
	ws, ok := ee.Sys().(syscall.WaitStatus)
	return ok && ws.Signaled() && ws.Signal() == syscall.SIGKILL
}

// sweepAll removes everything of the test's backend: a backend that knows no sandbox
// reconciles.
func sweepAll(t *testing.T, spec adoptSpec) {
	ctx := context.Background()
	cfg := spec.Config
	cfg.DataPlane = dataplane.NewClient(spec.Socket)
	b, err := New(ctx, cfg)
	if err != nil {
		t.Error(err)
		return
	}
	if _, err := b.Reconcile(ctx, nil); err != nil {
		t.Error(err)
	}
	if err := b.ReconcileCaptures(ctx, nil); err != nil {
		t.Error(err)
	}
	if err := b.pool.Teardown(ctx); err != nil {
		t.Error(err)
	}
	assertClean(t, b)
}
