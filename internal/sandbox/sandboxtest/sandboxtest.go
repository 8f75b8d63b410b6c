// Package sandboxtest is the conformance suite of sandbox backends, in the manner of
// repositorytest: a backend's test calls Run with a factory of fresh backends and gets
// checked every behaviour the orchestrator relies on (launch, envd reachable,
// pause/resume, snapshot and fork semantics as the backend's Capabilities declare them,
// idempotent stop, reconcile after a crash, resource limits).
//
// What happens inside a sandbox is reached through a Guest: EnvdGuest for backends that
// run the real envd (oci, microvm), the backend's own hooks for the mock.
package sandboxtest

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"slices"
	"testing"
	"time"

	"github.com/aenv-dev/aenv/internal/sandbox"
)

// Env is one backend under test.
type Env struct {
	// Backend is fresh: reconciled with no known sandboxes, nothing launched. The
	// factory's cleanup stops whatever the suite leaves and checks nothing leaked.
	Backend sandbox.Backend
	// Root is what sandboxes are launched on: a layered root where the backend snapshots.
	Root sandbox.RootFS
	// Resources of the sandboxes the suite launches (small: TCG guests touch memory slowly).
	Resources sandbox.Resources
	// Guest acts inside the backend's instances.
	Guest Guest
	// Crash drops the backend as a node killed with SIGKILL would (nothing is stopped;
	// what dies with the node's process dies) and returns a new backend over the same
	// host state, not yet reconciled. The old backend is not used again.
	Crash func(t *testing.T) sandbox.Backend
	// Survives says the sandboxes outlive a crash (their disks are served by a data plane):
	// Reconcile must then adopt the known one, not merely may.
	Survives bool
	// Ready is how long a launched sandbox's envd may take to answer (default 30 s).
	Ready time.Duration
}

// Factory returns a fresh Env; it skips the test (naming what is missing) where the
// backend cannot run.
type Factory func(t *testing.T) *Env

// Guest does what the suite needs inside a running instance.
type Guest interface {
	// WriteFile writes data (a short text) at path, durably enough for a snapshot.
	WriteFile(ctx context.Context, inst sandbox.Instance, path, data string) error
	// ReadFile returns the file's text; a missing file is an error wrapping os.ErrNotExist.
	ReadFile(ctx context.Context, inst sandbox.Instance, path string) (string, error)
	// StartProcess starts a background process named name that runs until stopped.
	StartProcess(ctx context.Context, inst sandbox.Instance, name string) error
	// Running reports whether the process StartProcess named name runs in inst.
	Running(ctx context.Context, inst sandbox.Instance, name string) (bool, error)
	// Limits are the resources the sandbox sees: CPUs (cgroup quota, else online CPUs)
	// and memory in MiB (cgroup limit, else MemTotal; a VM's kernel keeps some).
	Limits(ctx context.Context, inst sandbox.Instance) (sandbox.Resources, error)
}

// Run runs the whole suite.
func Run(t *testing.T, newEnv Factory) {
	t.Run("LaunchReachStop", func(t *testing.T) { testLaunch(t, newEnv(t)) })
	t.Run("StopIdempotent", func(t *testing.T) { testStop(t, newEnv(t)) })
	t.Run("PauseResume", func(t *testing.T) { testPauseResume(t, newEnv(t)) })
	t.Run("Snapshot", func(t *testing.T) { testSnapshot(t, newEnv(t)) })
	t.Run("Fork", func(t *testing.T) { testFork(t, newEnv(t)) })
	t.Run("ReconcileAfterCrash", func(t *testing.T) { testReconcile(t, newEnv(t)) })
	t.Run("Limits", func(t *testing.T) { testLimits(t, newEnv(t)) })
}

func (e *Env) ready() time.Duration {
	if e.Ready > 0 {
		return e.Ready
	}
	return 30 * time.Second
}

// launch starts plan and waits until envd answers.
func (e *Env) launch(t *testing.T, plan sandbox.LaunchPlan) sandbox.Instance {
	t.Helper()
	if plan.Resources == (sandbox.Resources{}) {
		plan.Resources = e.Resources
	}
	if plan.Kind != sandbox.LaunchResume && len(plan.RootFS.Layers) == 0 && plan.RootFS.LowerDir == "" {
		plan.RootFS = e.Root
	}
	inst, err := e.Backend.Launch(context.Background(), plan)
	if err != nil {
		t.Fatalf("launch %s (kind %d): %v", plan.SandboxID, plan.Kind, err)
	}
	if inst.ID() != plan.SandboxID {
		t.Fatalf("launched instance has id %q, want %q", inst.ID(), plan.SandboxID)
	}
	if err := WaitEnvd(inst, e.ready()); err != nil {
		t.Fatalf("envd of %s: %v", plan.SandboxID, err)
	}
	return inst
}

func (e *Env) fresh(t *testing.T, id string) sandbox.Instance {
	t.Helper()
	return e.launch(t, sandbox.LaunchPlan{Kind: sandbox.LaunchFresh, SandboxID: id})
}

// WaitEnvd polls envd's /health on the instance's endpoint until it answers 2xx.
func WaitEnvd(inst sandbox.Instance, timeout time.Duration) error {
	deadline := time.Now().Add(timeout)
	for {
		err := probeEnvd(inst)
		if err == nil {
			return nil
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("not answering after %s: %w", timeout, err)
		}
		time.Sleep(10 * time.Millisecond)
	}
}

func probeEnvd(inst sandbox.Instance) error {
	ep := inst.Endpoint()
	c := http.Client{Timeout: time.Second}
	resp, err := c.Get(fmt.Sprintf("http://%s/health", endpointAddr(ep)))
	if err != nil {
		return err
	}
	resp.Body.Close()
	if resp.StatusCode >= 300 {
		return fmt.Errorf("GET /health: %s", resp.Status)
	}
	return nil
}

func endpointAddr(ep sandbox.Endpoint) string {
	if ep.EnvdPort == 0 {
		ep.EnvdPort = 49983
	}
	return fmt.Sprintf("%s:%d", ep.Host, ep.EnvdPort)
}

func stop(t *testing.T, inst sandbox.Instance) {
	t.Helper()
	if err := inst.Stop(context.Background()); err != nil {
		t.Errorf("stop %s: %v", inst.ID(), err)
	}
}

func mustWrite(t *testing.T, e *Env, inst sandbox.Instance, path, data string) {
	t.Helper()
	if err := e.Guest.WriteFile(context.Background(), inst, path, data); err != nil {
		t.Fatalf("%s: write %s: %v", inst.ID(), path, err)
	}
}

// wantFile checks path holds want in inst ("" means: must not exist).
func wantFile(t *testing.T, e *Env, inst sandbox.Instance, path, want string) {
	t.Helper()
	got, err := e.Guest.ReadFile(context.Background(), inst, path)
	switch {
	case want == "" && err == nil:
		t.Errorf("%s: %s exists (%q), want it absent", inst.ID(), path, got)
	case want != "" && err != nil:
		t.Errorf("%s: read %s: %v, want %q", inst.ID(), path, err, want)
	case want != "" && got != want:
		t.Errorf("%s: %s = %q, want %q", inst.ID(), path, got, want)
	}
}

func wantRunning(t *testing.T, e *Env, inst sandbox.Instance, name string, want bool, why string) {
	t.Helper()
	got, err := e.Guest.Running(context.Background(), inst, name)
	if err != nil {
		t.Fatalf("%s: is %s running: %v", inst.ID(), name, err)
	}
	if got != want {
		t.Errorf("%s: process %s running = %v, want %v (%s)", inst.ID(), name, got, want, why)
	}
}

func testLaunch(t *testing.T, e *Env) {
	ctx := context.Background()
	a := e.fresh(t, "ct-launch-a")
	b := e.fresh(t, "ct-launch-b")
	if endpointAddr(a.Endpoint()) == endpointAddr(b.Endpoint()) {
		t.Fatalf("two sandboxes share the endpoint %s", endpointAddr(a.Endpoint()))
	}
	mustWrite(t, e, a, "/tmp/ct-mark", "a")
	wantFile(t, e, a, "/tmp/ct-mark", "a")
	wantFile(t, e, b, "/tmp/ct-mark", "")
	if err := e.Guest.StartProcess(ctx, a, "ct-proc"); err != nil {
		t.Fatal(err)
	}
	wantRunning(t, e, a, "ct-proc", true, "just started")
	wantRunning(t, e, b, "ct-proc", false, "started in another sandbox")
	st, err := a.Stats(ctx)
	if err != nil || st.Timestamp.IsZero() {
		t.Errorf("stats of a running sandbox: %+v, %v", st, err)
	}
	if _, err := e.Backend.Launch(ctx, sandbox.LaunchPlan{Kind: sandbox.LaunchFresh, SandboxID: "ct-launch-a",
		RootFS: e.Root, Resources: e.Resources}); err == nil {
		t.Error("a second launch under a running sandbox's id succeeded")
	}
	stop(t, a)
	stop(t, b)
}

func testStop(t *testing.T, e *Env) {
	ctx := context.Background()
	a := e.fresh(t, "ct-stop")
	ep := a.Endpoint()
	for n := range 2 {
		if err := a.Stop(ctx); err != nil {
			t.Fatalf("stop #%d: %v", n+1, err)
		}
	}
	if err := probeEnvd(a); err == nil {
		t.Errorf("envd of a stopped sandbox still answers on %s", endpointAddr(ep))
	}
	if _, err := a.Stats(ctx); err == nil {
		t.Error("stats of a stopped sandbox succeeded")
	}
	// The id is free again (a resume launches under the same id).
	again := e.fresh(t, "ct-stop")
	wantFile(t, e, again, "/tmp/ct-mark", "")
	stop(t, again)
}

// pauseResume pauses inst (keeping memory) and brings it back, in place or through
// Launch as the backend's Resume says.
func pauseResume(t *testing.T, e *Env, inst sandbox.Instance) sandbox.Instance {
	t.Helper()
	ctx := context.Background()
	ps, err := inst.Pause(ctx, sandbox.PauseOptions{KeepMemory: true})
	if err != nil {
		t.Fatalf("pause: %v", err)
	}
	err = inst.Resume(ctx)
	if err == nil {
		if err := WaitEnvd(inst, e.ready()); err != nil {
			t.Fatalf("envd after resume in place: %v", err)
		}
		return inst
	}
	if !errors.Is(err, sandbox.ErrGone) {
		t.Fatalf("resume: %v (want nil, or ErrGone for a pause that stops the instance)", err)
	}
	// A stopped pause: the state survives an encode/decode, as across a node restart.
	raw, err := ps.Encode()
	if err != nil {
		t.Fatalf("encode paused state: %v", err)
	}
	dec, err := e.Backend.DecodePaused(raw)
	if err != nil {
		t.Fatalf("decode paused state: %v", err)
	}
	return e.launch(t, sandbox.LaunchPlan{Kind: sandbox.LaunchResume, SandboxID: inst.ID(), Paused: dec, RootFS: e.Root})
}

func testPauseResume(t *testing.T, e *Env) {
	ctx := context.Background()
	caps := e.Backend.Capabilities()
	a := e.fresh(t, "ct-pause")
	mustWrite(t, e, a, "/root/ct-before", "before")
	if err := e.Guest.StartProcess(ctx, a, "ct-pausedproc"); err != nil {
		t.Fatal(err)
	}
	r := pauseResume(t, e, a)
	wantFile(t, e, r, "/root/ct-before", "before")
	wantRunning(t, e, r, "ct-pausedproc", caps.PauseKeepsProcesses, "Capabilities.PauseKeepsProcesses")
	mustWrite(t, e, r, "/root/ct-after", "after")
	wantFile(t, e, r, "/root/ct-after", "after")
	stop(t, r)
}

// needSnapshots skips backends that declare no snapshots, after checking that a
// snapshot is refused rather than half-made.
func needSnapshots(t *testing.T, e *Env) {
	t.Helper()
	if e.Backend.Capabilities().Snapshots {
		return
	}
	a := e.fresh(t, "ct-nosnap")
	if _, err := a.Snapshot(context.Background()); err == nil {
		t.Error("Snapshot succeeded on a backend whose Capabilities say no snapshots")
	}
	stop(t, a)
	t.Skip("the backend declares no snapshots")
}

// discard hands a capture back to a backend that frees captures.
func discard(t *testing.T, e *Env, c sandbox.Captured) {
	t.Helper()
	if d, ok := e.Backend.(sandbox.SnapshotDiscarder); ok {
		if err := d.DiscardSnapshot(context.Background(), c); err != nil {
			t.Errorf("discard snapshot: %v", err)
		}
	}
}

// capture snapshots inst and round-trips the capture through its encoding, as the
// catalog stores it.
func capture(t *testing.T, e *Env, inst sandbox.Instance) sandbox.Captured {
	t.Helper()
	c, err := inst.Snapshot(context.Background())
	if err != nil {
		t.Fatalf("snapshot: %v", err)
	}
	raw, err := c.Encode()
	if err != nil {
		t.Fatalf("encode capture: %v", err)
	}
	dec, err := e.Backend.DecodeCaptured(raw)
	if err != nil {
		t.Fatalf("decode capture %s: %v", raw, err)
	}
	return dec
}

func testSnapshot(t *testing.T, e *Env) {
	needSnapshots(t, e)
	ctx := context.Background()
	caps := e.Backend.Capabilities()
	src := e.fresh(t, "ct-snap-src")
	mustWrite(t, e, src, "/root/ct-snap", "captured")
	if err := e.Guest.StartProcess(ctx, src, "ct-snapproc"); err != nil {
		t.Fatal(err)
	}
	c := capture(t, e, src)
	// The source keeps running, and its later writes are not in the capture.
	wantRunning(t, e, src, "ct-snapproc", true, "a snapshot leaves its source running")
	mustWrite(t, e, src, "/root/ct-snap", "later")
	mustWrite(t, e, src, "/root/ct-later", "later")

	child := e.launch(t, sandbox.LaunchPlan{Kind: sandbox.LaunchFromSnapshot, SandboxID: "ct-snap-child", Snapshot: c})
	wantFile(t, e, child, "/root/ct-snap", "captured")
	wantFile(t, e, child, "/root/ct-later", "")
	wantRunning(t, e, child, "ct-snapproc", caps.MemorySnapshots, "Capabilities.MemorySnapshots")
	mustWrite(t, e, child, "/root/ct-snap", "child")
	wantFile(t, e, src, "/root/ct-snap", "later")

	cold := e.launch(t, sandbox.LaunchPlan{Kind: sandbox.LaunchFromSnapshot, SandboxID: "ct-snap-cold", Snapshot: c, ColdBoot: true})
	wantFile(t, e, cold, "/root/ct-snap", "captured")
	wantRunning(t, e, cold, "ct-snapproc", false, "LaunchPlan.ColdBoot starts fresh processes")
	for _, i := range []sandbox.Instance{child, cold, src} {
		stop(t, i)
	}
	discard(t, e, c)
}

func testFork(t *testing.T, e *Env) {
	needSnapshots(t, e)
	ctx := context.Background()
	caps := e.Backend.Capabilities()
	parent := e.fresh(t, "ct-fork-parent")
	mustWrite(t, e, parent, "/root/ct-shared", "shared")
	if err := e.Guest.StartProcess(ctx, parent, "ct-forkproc"); err != nil {
		t.Fatal(err)
	}
	// As the orchestrator forks: one capture, N launches on it.
	c := capture(t, e, parent)
	var kids []sandbox.Instance
	for n := range 3 {
		kids = append(kids, e.launch(t, sandbox.LaunchPlan{Kind: sandbox.LaunchFromSnapshot,
			SandboxID: fmt.Sprintf("ct-fork-%d", n), Snapshot: c}))
	}
	eps := map[string]bool{endpointAddr(parent.Endpoint()): true}
	for n, k := range kids {
		if eps[endpointAddr(k.Endpoint())] {
			t.Errorf("fork child %d shares the endpoint %s", n, endpointAddr(k.Endpoint()))
		}
		eps[endpointAddr(k.Endpoint())] = true
		wantFile(t, e, k, "/root/ct-shared", "shared")
		wantRunning(t, e, k, "ct-forkproc", caps.LiveFork, "Capabilities.LiveFork")
		mustWrite(t, e, k, "/root/ct-own", fmt.Sprint(n))
	}
	// Children write independently of each other and of the parent.
	for n, k := range kids {
		wantFile(t, e, k, "/root/ct-own", fmt.Sprint(n))
	}
	wantFile(t, e, parent, "/root/ct-own", "")
	wantRunning(t, e, parent, "ct-forkproc", true, "a fork leaves its parent running")
	for _, k := range append(kids, parent) {
		stop(t, k)
	}
	discard(t, e, c)
}

func testReconcile(t *testing.T, e *Env) {
	if e.Crash == nil {
		t.Skip("the factory cannot simulate a crash")
	}
	ctx := context.Background()
	keep := e.fresh(t, "ct-rec-known")
	lost := e.fresh(t, "ct-rec-unknown")
	mustWrite(t, e, keep, "/root/ct-kept", "kept")
	b2 := e.Crash(t)
	alive, err := b2.Reconcile(ctx, []string{"ct-rec-known", "ct-rec-never"})
	if err != nil {
		t.Fatalf("reconcile: %v", err)
	}
	e.Backend = b2
	ids := make([]string, 0, len(alive))
	for id := range alive {
		ids = append(ids, id)
	}
	// Only known ids come back (a backend whose sandboxes die with the node returns none).
	if slices.ContainsFunc(ids, func(id string) bool { return id != "ct-rec-known" }) {
		t.Fatalf("alive after reconcile: %v, want at most ct-rec-known", ids)
	}
	if err := probeEnvd(lost); err == nil {
		t.Errorf("a sandbox the node did not know still answers after reconcile")
	}
	if inst := alive["ct-rec-known"]; inst != nil {
		if inst.ID() != "ct-rec-known" || endpointAddr(inst.Endpoint()) != endpointAddr(keep.Endpoint()) {
			t.Errorf("adopted %s at %s, was at %s", inst.ID(), endpointAddr(inst.Endpoint()), endpointAddr(keep.Endpoint()))
		}
		if err := WaitEnvd(inst, e.ready()); err != nil {
			t.Fatalf("adopted sandbox: %v", err)
		}
		wantFile(t, e, inst, "/root/ct-kept", "kept")
		stop(t, inst)
	} else if e.Survives {
		t.Errorf("the known sandbox was not adopted, although it outlives a crash")
	} else if err := probeEnvd(keep); err == nil {
		t.Errorf("a known sandbox answers but reconcile did not report it alive")
	}
	// The new backend launches under the old ids.
	stop(t, e.fresh(t, "ct-rec-unknown"))
}

func testLimits(t *testing.T, e *Env) {
	ctx := context.Background()
	for _, res := range []sandbox.Resources{
		{CPUCount: 1, MemoryMB: 128, DiskSizeMB: e.Resources.DiskSizeMB},
		{CPUCount: 2, MemoryMB: 256, DiskSizeMB: e.Resources.DiskSizeMB},
	} {
		id := fmt.Sprintf("ct-limits-%d", res.CPUCount)
		inst := e.launch(t, sandbox.LaunchPlan{Kind: sandbox.LaunchFresh, SandboxID: id, Resources: res})
		got, err := e.Guest.Limits(ctx, inst)
		if err != nil {
			t.Fatalf("%s: limits: %v", id, err)
		}
		// A VM's kernel keeps part of its RAM: up to 20 %, or 40 MiB (its code and data:
		// ~36 MiB for Debian's 6.1 cloud kernel, 92 of 128 MiB left), below the request.
		if got.CPUCount != res.CPUCount || got.MemoryMB > res.MemoryMB || got.MemoryMB < min(res.MemoryMB*8/10, res.MemoryMB-40) {
			t.Errorf("%s: the sandbox sees %d CPUs and %d MiB, asked for %d and %d", id, got.CPUCount, got.MemoryMB, res.CPUCount, res.MemoryMB)
		}
		stop(t, inst)
	}
}
