package orchestrator

import (
	"context"
	"errors"
	"slices"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus/testutil"

	"github.com/aenv-dev/aenv/internal/sandbox"
	"github.com/aenv-dev/aenv/internal/sandbox/mock"
)

var backendModes = []struct {
	name string
	opts mock.Options
}{
	{"freezer", mock.Options{Capabilities: sandbox.Capabilities{PauseKeepsProcesses: true}}},
	{"stop-on-pause", mock.Options{StopOnPause: true,
		Capabilities: sandbox.Capabilities{MemorySnapshots: true, PauseKeepsProcesses: true, PauseReleasesMemory: true}}},
}

func TestPauseConnectResume(t *testing.T) {
	ctx := context.Background()
	for _, mode := range backendModes {
		t.Run(mode.name, func(t *testing.T) {
			h := newHarness(t, mode.opts, nil)
			sb := h.create(CreateRequest{Secure: true, Timeout: time.Minute})

			if err := h.o.Pause(ctx, sb.ID, sandbox.PauseOptions{KeepMemory: true}); err != nil {
				t.Fatal(err)
			}
			if got := h.state(sb.ID); got != StatePaused {
				t.Fatalf("state after pause %q", got)
			}
			if st := h.stored(sb.ID); st == nil || st.State != StatePaused || len(st.Paused) == 0 {
				t.Fatalf("persisted after pause: %+v", st)
			}
			if err := h.o.Pause(ctx, sb.ID, sandbox.PauseOptions{}); !errors.Is(err, ErrConflict) {
				t.Fatalf("second pause: %v, want ErrConflict", err)
			}
			if err := h.o.SetTimeout(ctx, sb.ID, time.Minute); !errors.Is(err, ErrConflict) {
				t.Fatalf("timeout on paused: %v, want ErrConflict", err)
			}
			if ms, err := h.o.Metrics(ctx, sb.ID); err != nil || len(ms) != 0 {
				t.Fatalf("metrics of paused = %v, %v", ms, err)
			}
			items, _, _ := h.o.List(ctx, ListFilter{States: []string{"paused"}})
			if len(items) != 1 || items[0].ID != sb.ID {
				t.Fatalf("paused list = %v", items)
			}

			h.clock.Advance(10 * time.Minute) // paused sandboxes never expire
			h.settle()
			if h.state(sb.ID) != StatePaused {
				t.Fatal("paused sandbox expired")
			}

			got, resumed, err := h.o.Connect(ctx, sb.ID, ConnectOptions{Timeout: 90 * time.Second})
			if err != nil || !resumed {
				t.Fatalf("connect to paused: resumed=%v err=%v", resumed, err)
			}
			if got.ID != sb.ID || got.EnvdAccessToken != sb.EnvdAccessToken || got.State != StateRunning {
				t.Fatalf("resumed record %+v", got)
			}
			if want := h.clock.Now().Add(90 * time.Second); !got.EndAt.Equal(want) {
				t.Fatalf("endAt after resume %v, want %v", got.EndAt, want)
			}
			if st := h.stored(sb.ID); st.State != StateRunning || st.Paused != nil {
				t.Fatalf("persisted after resume: %+v", st)
			}
			inst := h.b.Instance(sb.ID)
			if inst == nil || inst.Frozen() {
				t.Fatal("instance not running after resume")
			}
			launches := h.b.Launches()
			if mode.opts.StopOnPause {
				if len(launches) != 2 || launches[1].Kind != sandbox.LaunchResume || launches[1].SandboxID != sb.ID ||
					launches[1].RootFS.LowerDir != "/srv/base" {
					t.Fatalf("launches %+v", launches)
				}
				in := inst.Envd().Inits()
				if len(in) != 1 || in[0].HeaderToken != sb.EnvdAccessToken || in[0].AccessToken != sb.EnvdAccessToken {
					t.Fatalf("re-init after relaunch %+v", in)
				}
			} else if len(launches) != 1 {
				t.Fatalf("freezer resume relaunched: %+v", launches)
			}

			// Connect to a running sandbox only extends.
			end := got.EndAt
			got, resumed, err = h.o.Connect(ctx, sb.ID, ConnectOptions{Timeout: time.Second})
			if err != nil || resumed || !got.EndAt.Equal(end) {
				t.Fatalf("short connect: resumed=%v end=%v err=%v (want unchanged %v)", resumed, got.EndAt, err, end)
			}
			got, _, _ = h.o.Connect(ctx, sb.ID, ConnectOptions{Timeout: time.Hour})
			if want := h.clock.Now().Add(time.Hour); !got.EndAt.Equal(want) || !h.stored(sb.ID).EndAt.Equal(want) {
				t.Fatalf("long connect endAt %v, want %v", got.EndAt, want)
			}
		})
	}
}

func TestKill(t *testing.T) {
	ctx := context.Background()
	for _, mode := range backendModes {
		t.Run(mode.name, func(t *testing.T) {
			h := newHarness(t, mode.opts, nil)
			run := h.create(CreateRequest{})
			paused := h.create(CreateRequest{})
			if err := h.o.Pause(ctx, paused.ID, sandbox.PauseOptions{}); err != nil {
				t.Fatal(err)
			}
			for _, id := range []string{run.ID, paused.ID} {
				if err := h.o.Kill(ctx, id); err != nil {
					t.Fatalf("kill %s: %v", id, err)
				}
				if _, err := h.o.Get(ctx, id); !errors.Is(err, ErrNotFound) {
					t.Fatalf("get after kill: %v", err)
				}
				if h.stored(id) != nil {
					t.Fatal("record survives kill")
				}
				if err := h.o.Kill(ctx, id); !errors.Is(err, ErrNotFound) {
					t.Fatalf("second kill: %v", err)
				}
			}
			if live := h.b.Live(); len(live) != 0 {
				t.Fatalf("instances after kill: %v", live)
			}
			if mode.opts.StopOnPause {
				if !slices.Contains(h.b.Discarded(), paused.ID) || len(h.b.Artifacts()) != 0 {
					t.Fatalf("paused state not discarded: discarded=%v artifacts=%v", h.b.Discarded(), h.b.Artifacts())
				}
			}
			if got := testutil.ToFloat64(h.o.m.kills.WithLabelValues("api")); got != 2 {
				t.Fatalf("kills = %v", got)
			}
		})
	}
}

func TestUnknownSandbox(t *testing.T) {
	h := newHarness(t, mock.Options{}, nil)
	ctx := context.Background()
	calls := map[string]func() error{
		"get":     func() error { _, err := h.o.Get(ctx, "nope"); return err },
		"connect": func() error { _, _, err := h.o.Connect(ctx, "nope", ConnectOptions{}); return err },
		"kill":    func() error { return h.o.Kill(ctx, "nope") },
		"pause":   func() error { return h.o.Pause(ctx, "nope", sandbox.PauseOptions{}) },
		"timeout": func() error { return h.o.SetTimeout(ctx, "nope", time.Second) },
		"refresh": func() error { return h.o.Refresh(ctx, "nope", time.Second) },
		"metrics": func() error { _, err := h.o.Metrics(ctx, "nope"); return err },
		"endpoint": func() error {
			_, _, err := h.o.Endpoint(ctx, "nope", true)
			return err
		},
	}
	for name, call := range calls {
		if err := call(); !errors.Is(err, ErrNotFound) {
			t.Errorf("%s: %v, want ErrNotFound", name, err)
		}
	}
}

func TestPauseFailures(t *testing.T) {
	ctx := context.Background()
	boom := errors.New("boom")
	cases := []struct {
		name      string
		mode      mock.Options
		inject    func(h *harness)
		wantState State // "" = removed
	}{
		{"recoverable backend error", backendModes[0].opts, func(h *harness) { h.b.Fail(mock.StagePause, boom, 1) }, StateRunning},
		{"instance gone", backendModes[0].opts, func(h *harness) { h.b.Fail(mock.StagePause, sandbox.ErrGone, 1) }, ""},
		{"persist fails, thaw", backendModes[0].opts, func(h *harness) { h.store.failPuts(1) }, StateRunning},
		{"persist fails, relaunch", backendModes[1].opts, func(h *harness) { h.store.failPuts(1) }, StateRunning},
		{"persist and relaunch fail", backendModes[1].opts, func(h *harness) {
			h.store.failPuts(1)
			h.b.Fail(mock.StageLaunch, boom, 1)
		}, ""},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			h := newHarness(t, tc.mode, nil)
			sb := h.create(CreateRequest{Timeout: time.Minute})
			tc.inject(h)
			if err := h.o.Pause(ctx, sb.ID, sandbox.PauseOptions{}); err == nil {
				t.Fatal("pause succeeded despite the failure")
			}
			if got := h.state(sb.ID); got != tc.wantState {
				t.Fatalf("state %q, want %q", got, tc.wantState)
			}
			if tc.wantState == "" {
				if h.stored(sb.ID) != nil || len(h.b.Live()) != 0 || len(h.b.Artifacts()) != 0 {
					t.Fatalf("leftovers: record=%v live=%v artifacts=%v", h.stored(sb.ID), h.b.Live(), h.b.Artifacts())
				}
				return
			}
			inst := h.b.Instance(sb.ID)
			if inst == nil || inst.Frozen() {
				t.Fatal("sandbox reported running but instance is not")
			}
			if st := h.stored(sb.ID); st == nil || st.State != StateRunning {
				t.Fatalf("persisted %+v", st)
			}
			// TTL is still armed after the rollback.
			h.clock.Advance(time.Minute)
			h.settle()
			if h.state(sb.ID) != "" {
				t.Fatal("TTL lost after a failed pause")
			}
		})
	}
}

func TestResumeFailures(t *testing.T) {
	ctx := context.Background()
	boom := errors.New("boom")
	cases := []struct {
		name   string
		mode   mock.Options
		inject func(h *harness)
	}{
		{"thaw", backendModes[0].opts, func(h *harness) { h.b.Fail(mock.StageResume, boom, 1) }},
		{"relaunch", backendModes[1].opts, func(h *harness) { h.b.Fail(mock.StageLaunch, boom, 1) }},
		{"envd after relaunch", backendModes[1].opts, func(h *harness) { h.b.Fail(mock.StageEnvdInit, boom, 1) }},
		{"persist, thaw", backendModes[0].opts, func(h *harness) { h.store.failPuts(1) }},
		{"persist, relaunch", backendModes[1].opts, func(h *harness) { h.store.failPuts(1) }},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			h := newHarness(t, tc.mode, nil)
			sb := h.create(CreateRequest{Secure: true})
			if err := h.o.Pause(ctx, sb.ID, sandbox.PauseOptions{}); err != nil {
				t.Fatal(err)
			}
			tc.inject(h)
			if _, _, err := h.o.Connect(ctx, sb.ID, ConnectOptions{}); err == nil {
				t.Fatal("connect succeeded despite the failure")
			}
			if got := h.state(sb.ID); got != StatePaused {
				t.Fatalf("state %q after failed resume, want paused", got)
			}
			if st := h.stored(sb.ID); st == nil || st.State != StatePaused {
				t.Fatalf("persisted %+v", st)
			}
			if inst := h.b.Instance(sb.ID); inst != nil && !inst.Frozen() {
				t.Fatal("instance runs while the sandbox is reported paused")
			}
			// And it resumes once the fault is gone, with the same token.
			got, resumed, err := h.o.Connect(ctx, sb.ID, ConnectOptions{})
			if err != nil || !resumed || got.EnvdAccessToken != sb.EnvdAccessToken {
				t.Fatalf("retry: %+v resumed=%v err=%v", got, resumed, err)
			}
		})
	}
}

func TestKillStopFailureKeepsSandbox(t *testing.T) {
	ctx := context.Background()
	h := newHarness(t, mock.Options{}, nil)
	sb := h.create(CreateRequest{Timeout: time.Minute})
	h.b.Fail(mock.StageStop, errors.New("stuck"), 1)
	if err := h.o.Kill(ctx, sb.ID); err == nil {
		t.Fatal("kill reported success though stop failed")
	}
	if h.state(sb.ID) != StateRunning || h.stored(sb.ID) == nil {
		t.Fatal("failed kill lost the sandbox")
	}
	if err := h.o.Kill(ctx, sb.ID); err != nil {
		t.Fatal(err)
	}
}

func TestEndpoint(t *testing.T) {
	ctx := context.Background()
	for _, mode := range backendModes {
		t.Run(mode.name, func(t *testing.T) {
			h := newHarness(t, mode.opts, nil)
			auto := h.create(CreateRequest{AutoResume: true})
			plain := h.create(CreateRequest{})

			ep, sb, err := h.o.Endpoint(ctx, auto.ID, false)
			if err != nil || sb.ID != auto.ID || ep != h.b.Instance(auto.ID).Endpoint() || ep.EnvdPort == 0 {
				t.Fatalf("running endpoint %+v %v", ep, err)
			}
			for _, id := range []string{auto.ID, plain.ID} {
				if err := h.o.Pause(ctx, id, sandbox.PauseOptions{}); err != nil {
					t.Fatal(err)
				}
			}
			if _, _, err := h.o.Endpoint(ctx, plain.ID, true); !errors.Is(err, ErrNotRunning) || !errors.Is(err, ErrPaused) {
				t.Fatalf("paused without autoResume: %v", err)
			}
			if _, _, err := h.o.Endpoint(ctx, auto.ID, false); !errors.Is(err, ErrNotRunning) {
				t.Fatalf("caller did not allow resume: %v", err)
			}
			ep, sb, err = h.o.Endpoint(ctx, auto.ID, true)
			if err != nil || sb.State != StateRunning || ep.EnvdPort == 0 {
				t.Fatalf("auto-resume endpoint %+v %+v %v", ep, sb, err)
			}
			if want := h.clock.Now().Add(h.o.cfg.DefaultTimeout); !sb.EndAt.Equal(want) {
				t.Fatalf("auto-resumed TTL %v, want %v", sb.EndAt, want)
			}
		})
	}
}

func TestMetricsAndGauges(t *testing.T) {
	ctx := context.Background()
	h := newHarness(t, backendModes[1].opts, nil)
	a := h.create(CreateRequest{Resources: sandbox.Resources{CPUCount: 2, MemoryMB: 1024}})
	h.create(CreateRequest{Resources: sandbox.Resources{CPUCount: 1, MemoryMB: 512}})
	ms, err := h.o.Metrics(ctx, a.ID)
	if err != nil || len(ms) != 1 || ms[0].CPUCount != 2 || ms[0].MemTotal != 1024<<20 {
		t.Fatalf("metrics %+v %v", ms, err)
	}
	if err := h.o.Pause(ctx, a.ID, sandbox.PauseOptions{}); err != nil {
		t.Fatal(err)
	}
	want := map[string]float64{
		"aenv_sandboxes_running":              1,
		"aenv_sandboxes_paused":               1,
		"aenv_sandbox_allocated_cpus":         1, // the paused one released its share
		"aenv_sandbox_allocated_memory_bytes": 512 << 20,
	}
	mfs, err := h.reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	seen := map[string]bool{}
	for _, mf := range mfs {
		name := mf.GetName()
		seen[name] = true
		if w, ok := want[name]; ok {
			if got := mf.GetMetric()[0].GetGauge().GetValue(); got != w {
				t.Errorf("%s = %v, want %v", name, got, w)
			}
		}
	}
	for _, n := range []string{"aenv_sandbox_stage_duration_seconds", "aenv_sandbox_creates_total"} {
		if !seen[n] {
			t.Errorf("metric %s not exported", n)
		}
	}
	if c := testutil.CollectAndCount(h.o.m.stage, "aenv_sandbox_stage_duration_seconds"); c == 0 {
		t.Fatal("no stage observations")
	}
	for _, stage := range []string{stageLaunch, stageEnvdWait, stageEnvdInit, stagePersist, stageTotal} {
		if n := histCount(t, h, opCreate, stage, "ok"); n != 2 {
			t.Errorf("create/%s observed %d times, want 2", stage, n)
		}
	}
	if n := histCount(t, h, opPause, stagePause, "ok"); n != 1 {
		t.Errorf("pause/pause observed %d times", n)
	}
}

func histCount(t *testing.T, h *harness, op, stage, status string) uint64 {
	t.Helper()
	mfs, _ := h.reg.Gather()
	for _, mf := range mfs {
		if mf.GetName() != "aenv_sandbox_stage_duration_seconds" {
			continue
		}
	metrics:
		for _, m := range mf.GetMetric() {
			want := map[string]string{"operation": op, "stage": stage, "status": status}
			for _, l := range m.GetLabel() {
				if want[l.GetName()] != l.GetValue() {
					continue metrics
				}
			}
			return m.GetHistogram().GetSampleCount()
		}
	}
	return 0
}
