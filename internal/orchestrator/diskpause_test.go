package orchestrator

import (
	"context"
	"errors"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/aenv-dev/aenv/internal/sandbox"
	"github.com/aenv-dev/aenv/internal/sandbox/mock"
)

// Pause with memory:false: the filesystem is captured, the instance stopped; connect
// relaunches under the same id and token with fresh processes and the same files.
func TestPauseToDiskAndConnect(t *testing.T) {
	ctx := context.Background()
	for _, mode := range snapModes {
		t.Run(mode.name, func(t *testing.T) {
			h := newHarness(t, mode.opts, func(c *Config) { c.MaxSandboxes = 1 })
			sb := h.create(CreateRequest{Secure: true, Timeout: time.Minute})
			h.inst(sb.ID).WriteFile("/work/state", []byte("42"))
			h.inst(sb.ID).StartProcess("agent")

			if err := h.o.Pause(ctx, sb.ID, sandbox.PauseOptions{KeepMemory: false}); err != nil {
				t.Fatal(err)
			}
			if h.state(sb.ID) != StatePaused || slices.Contains(h.b.Live(), sb.ID) {
				t.Fatalf("after pause to disk: state %q, live %v", h.state(sb.ID), h.b.Live())
			}
			st := h.stored(sb.ID)
			if st == nil || st.State != StatePaused || len(st.DiskSnapshot) == 0 || st.Paused != nil {
				t.Fatalf("persisted after pause to disk: %+v", st)
			}
			if err := h.o.Pause(ctx, sb.ID, sandbox.PauseOptions{}); !errors.Is(err, ErrConflict) {
				t.Fatalf("second pause = %v, want ErrConflict", err)
			}
			// A sandbox paused to disk holds no resources: another fits under the limit of 1.
			other := h.create(CreateRequest{Timeout: time.Minute})
			if err := h.o.Kill(ctx, other.ID); err != nil {
				t.Fatal(err)
			}

			got, resumed, err := h.o.Connect(ctx, sb.ID, ConnectOptions{Timeout: 90 * time.Second})
			if err != nil || !resumed {
				t.Fatalf("connect: resumed=%v err=%v", resumed, err)
			}
			if got.ID != sb.ID || got.EnvdAccessToken != sb.EnvdAccessToken || got.State != StateRunning {
				t.Fatalf("resumed record %+v", got)
			}
			inst := h.inst(sb.ID)
			if v := h.file(sb.ID, "/work/state"); v != "42" {
				t.Fatalf("file after resume = %q", v)
			}
			if p := inst.Processes(); len(p) != 0 {
				t.Fatalf("processes after resume from disk = %v, want fresh ones", p)
			}
			if inst.Plan().Kind != sandbox.LaunchFromSnapshot || inst.Plan().SandboxID != sb.ID || inst.Plan().SnapshotTemplate {
				t.Fatalf("resume plan %+v", inst.Plan())
			}
			inits := inst.Envd().Inits()
			if len(inits) != 1 || inits[0].AccessToken != sb.EnvdAccessToken || inits[0].HeaderToken != "" ||
				inits[0].EnvVars["E2B_SANDBOX_ID"] != sb.ID {
				t.Fatalf("envd init after cold resume: %+v", inits)
			}
			if st := h.stored(sb.ID); st.State != StateRunning || st.DiskSnapshot != nil {
				t.Fatalf("persisted after resume: %+v", st)
			}
			if !slices.Contains(h.b.DiscardedSnapshots(), sb.ID) {
				t.Fatal("disk snapshot not released after resume")
			}
		})
	}
}

func TestPauseToDiskSurvivesRestartAndKill(t *testing.T) {
	ctx := context.Background()
	h := newHarness(t, snapModes[0].opts, nil)
	keep := h.create(CreateRequest{Secure: true, Timeout: time.Minute})
	drop := h.create(CreateRequest{Timeout: time.Minute})
	h.inst(keep.ID).WriteFile("/f", []byte("kept"))
	for _, id := range []string{keep.ID, drop.ID} {
		if err := h.o.Pause(ctx, id, sandbox.PauseOptions{}); err != nil {
			t.Fatal(err)
		}
	}
	h.restart()
	if h.state(keep.ID) != StatePaused || h.state(drop.ID) != StatePaused {
		t.Fatal("disk-paused sandboxes lost in the restart")
	}
	if err := h.o.Kill(ctx, drop.ID); err != nil {
		t.Fatal(err)
	}
	if h.stored(drop.ID) != nil || !slices.Contains(h.b.DiscardedSnapshots(), drop.ID) {
		t.Fatal("kill of a disk-paused sandbox left its record or snapshot")
	}
	got, resumed, err := h.o.Connect(ctx, keep.ID, ConnectOptions{})
	if err != nil || !resumed || got.EnvdAccessToken != keep.EnvdAccessToken || h.file(keep.ID, "/f") != "kept" {
		t.Fatalf("resume after restart: %+v %v %v", got, resumed, err)
	}
}

// A node killed after a pause to disk was recorded but before the instance stopped
// comes back with the sandbox paused and the stray instance stopped.
func TestRestartStopsInstanceOfDiskPausedRecord(t *testing.T) {
	ctx := context.Background()
	h := newHarness(t, snapModes[0].opts, nil)
	sb := h.create(CreateRequest{Timeout: time.Minute})
	// Hold only the pause's stop; the restart's own stop of the stray instance proceeds.
	entered, release := make(chan struct{}), make(chan struct{})
	var once sync.Once
	h.b.SetHook(func(s mock.Stage, id string) error {
		if s == mock.StageStop {
			first := false
			once.Do(func() { first = true })
			if first {
				close(entered)
				<-release
			}
		}
		return nil
	})
	done := make(chan error, 1)
	go func() { done <- h.o.Pause(ctx, sb.ID, sandbox.PauseOptions{}) }()
	<-entered
	if st := h.stored(sb.ID); st == nil || len(st.DiskSnapshot) == 0 || st.State != StatePaused {
		t.Fatalf("record before the stop: %+v", st)
	}
	h.restart() // the node "dies" here; the old orchestrator is abandoned
	if h.state(sb.ID) != StatePaused || slices.Contains(h.b.Live(), sb.ID) {
		t.Fatalf("after restart: state %q live %v", h.state(sb.ID), h.b.Live())
	}
	close(release)
	<-done
}

func TestConnectColdBootFromMemoryPause(t *testing.T) {
	ctx := context.Background()
	h := newHarness(t, snapModes[0].opts, nil)
	sb := h.create(CreateRequest{Secure: true, Timeout: time.Minute})
	old := h.inst(sb.ID)
	old.WriteFile("/f", []byte("x"))
	old.StartProcess("agent")
	if err := h.o.Pause(ctx, sb.ID, sandbox.PauseOptions{KeepMemory: true}); err != nil {
		t.Fatal(err)
	}
	if !old.Frozen() {
		t.Fatal("memory pause on a container-like backend should freeze in place")
	}
	got, resumed, err := h.o.Connect(ctx, sb.ID, ConnectOptions{ColdBoot: true})
	if err != nil || !resumed || got.EnvdAccessToken != sb.EnvdAccessToken {
		t.Fatalf("cold connect: %+v %v %v", got, resumed, err)
	}
	inst := h.inst(sb.ID)
	if inst == old || len(inst.Processes()) != 0 || h.file(sb.ID, "/f") != "x" {
		t.Fatalf("cold boot kept the old instance or lost files: same=%v procs=%v", inst == old, inst.Processes())
	}
	// memory:true (the default) on a running sandbox changes nothing.
	if _, resumed, err := h.o.Connect(ctx, sb.ID, ConnectOptions{ColdBoot: true}); err != nil || resumed || h.b.Instance(sb.ID) != inst {
		t.Fatalf("cold connect of a running sandbox: resumed=%v err=%v", resumed, err)
	}
}

func TestPauseModeFollowsCapabilities(t *testing.T) {
	ctx := context.Background()
	for _, tc := range []struct {
		name   string
		caps   sandbox.Capabilities
		keep   bool
		toDisk bool
	}{
		{"no snapshots, memory:false pauses in place", sandbox.Capabilities{PauseKeepsProcesses: true}, false, false},
		{"snapshots, memory:true pauses in place", sandbox.Capabilities{PauseKeepsProcesses: true, Snapshots: true}, true, false},
		{"snapshots, memory:false pauses to disk", sandbox.Capabilities{PauseKeepsProcesses: true, Snapshots: true}, false, true},
		{"cannot keep processes: every pause goes to disk", sandbox.Capabilities{Snapshots: true}, true, true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			h := newHarness(t, mock.Options{Capabilities: tc.caps}, nil)
			sb := h.create(CreateRequest{Timeout: time.Minute})
			if err := h.o.Pause(ctx, sb.ID, sandbox.PauseOptions{KeepMemory: tc.keep}); err != nil {
				t.Fatal(err)
			}
			st := h.stored(sb.ID)
			if onDisk := len(st.DiskSnapshot) > 0; onDisk != tc.toDisk || onDisk == slices.Contains(h.b.Live(), sb.ID) {
				t.Fatalf("on disk = %v (live %v), want %v", onDisk, h.b.Live(), tc.toDisk)
			}
			if _, _, err := h.o.Connect(ctx, sb.ID, ConnectOptions{}); err != nil {
				t.Fatal(err)
			}
		})
	}
}

func TestAutoPauseToDiskAtTimeout(t *testing.T) {
	h := newHarness(t, snapModes[0].opts, nil)
	disk := h.create(CreateRequest{Timeout: time.Minute, AutoPause: true, AutoPauseDisk: true})
	mem := h.create(CreateRequest{Timeout: time.Minute, AutoPause: true})
	h.inst(disk.ID).WriteFile("/f", []byte("y"))
	h.clock.Advance(2 * time.Minute)
	h.settle()
	if h.state(disk.ID) != StatePaused || h.state(mem.ID) != StatePaused {
		t.Fatal("autoPause did not pause at the timeout")
	}
	if st := h.stored(disk.ID); len(st.DiskSnapshot) == 0 || slices.Contains(h.b.Live(), disk.ID) {
		t.Fatal("autoPauseMemory:false did not pause to disk")
	}
	if st := h.stored(mem.ID); len(st.DiskSnapshot) != 0 || !h.inst(mem.ID).Frozen() {
		t.Fatal("a memory autoPause went to disk")
	}
	// autoResume through the proxy path uses the same resume.
	h2 := newHarness(t, snapModes[0].opts, nil)
	sb := h2.create(CreateRequest{Timeout: time.Minute, AutoPause: true, AutoPauseDisk: true, AutoResume: true})
	h2.inst(sb.ID).WriteFile("/f", []byte("z"))
	h2.clock.Advance(2 * time.Minute)
	h2.settle()
	if _, _, err := h2.o.Endpoint(context.Background(), sb.ID, true); err != nil {
		t.Fatal(err)
	}
	if h2.file(sb.ID, "/f") != "z" {
		t.Fatal("autoResume from disk lost the file")
	}
}

func TestPauseToDiskFailuresKeepTheSandbox(t *testing.T) {
	ctx := context.Background()
	for _, tc := range []struct {
		name  string
		stage mock.Stage
		err   error
		want  State
	}{
		{"capture fails", mock.StageSnapshot, errors.New("freeze failed"), StateRunning},
		{"stop fails", mock.StageStop, errors.New("busy"), StateRunning},
	} {
		t.Run(tc.name, func(t *testing.T) {
			h := newHarness(t, snapModes[0].opts, nil)
			sb := h.create(CreateRequest{Timeout: time.Minute})
			h.b.Fail(tc.stage, tc.err, 1)
			if err := h.o.Pause(ctx, sb.ID, sandbox.PauseOptions{}); err == nil {
				t.Fatal("pause succeeded despite the failure")
			}
			if h.state(sb.ID) != tc.want || !slices.Contains(h.b.Live(), sb.ID) {
				t.Fatalf("state %q live %v", h.state(sb.ID), h.b.Live())
			}
			if st := h.stored(sb.ID); st.State != StateRunning || len(st.DiskSnapshot) != 0 {
				t.Fatalf("persisted %+v", st)
			}
			if err := h.o.Pause(ctx, sb.ID, sandbox.PauseOptions{}); err != nil {
				t.Fatalf("pause after the failure cleared: %v", err)
			}
		})
	}
	t.Run("resume launch fails", func(t *testing.T) {
		h := newHarness(t, snapModes[0].opts, nil)
		sb := h.create(CreateRequest{Timeout: time.Minute})
		h.inst(sb.ID).WriteFile("/f", []byte("w"))
		if err := h.o.Pause(ctx, sb.ID, sandbox.PauseOptions{}); err != nil {
			t.Fatal(err)
		}
		h.b.Fail(mock.StageLaunch, errors.New("no slot"), 1)
		if _, _, err := h.o.Connect(ctx, sb.ID, ConnectOptions{}); err == nil {
			t.Fatal("connect succeeded despite the launch failure")
		}
		if h.state(sb.ID) != StatePaused || len(h.stored(sb.ID).DiskSnapshot) == 0 {
			t.Fatal("failed resume lost the disk snapshot")
		}
		if _, _, err := h.o.Connect(ctx, sb.ID, ConnectOptions{}); err != nil || h.file(sb.ID, "/f") != "w" {
			t.Fatalf("retry: %v", err)
		}
	})
	t.Run("resume persist fails", func(t *testing.T) {
		h := newHarness(t, snapModes[0].opts, nil)
		sb := h.create(CreateRequest{Timeout: time.Minute})
		if err := h.o.Pause(ctx, sb.ID, sandbox.PauseOptions{}); err != nil {
			t.Fatal(err)
		}
		h.store.failPuts(1)
		if _, _, err := h.o.Connect(ctx, sb.ID, ConnectOptions{}); err == nil {
			t.Fatal("connect succeeded despite the catalog failure")
		}
		if h.state(sb.ID) != StatePaused || slices.Contains(h.b.Live(), sb.ID) {
			t.Fatalf("after failed persist: %q live %v", h.state(sb.ID), h.b.Live())
		}
		if _, _, err := h.o.Connect(ctx, sb.ID, ConnectOptions{}); err != nil {
			t.Fatal(err)
		}
	})
}

// A backend that can snapshot some sandboxes but not this one (the OCI backend and a
// directory template) pauses it in place for memory:false, and a cold-boot connect
// thaws it: the filesystem survives either way.
func TestPauseToDiskUnsupportedForThisSandbox(t *testing.T) {
	ctx := context.Background()
	h := newHarness(t, snapModes[0].opts, nil)
	sb := h.create(CreateRequest{Timeout: time.Minute, Secure: true})
	inst := h.inst(sb.ID)
	inst.WriteFile("/f", []byte("kept"))
	h.b.Fail(mock.StageSnapshot, sandbox.ErrUnsupported, -1)
	if err := h.o.Pause(ctx, sb.ID, sandbox.PauseOptions{}); err != nil {
		t.Fatal(err)
	}
	if h.state(sb.ID) != StatePaused || !inst.Frozen() || len(h.stored(sb.ID).DiskSnapshot) != 0 {
		t.Fatal("memory:false on an uncapturable sandbox did not pause it in place")
	}
	got, resumed, err := h.o.Connect(ctx, sb.ID, ConnectOptions{ColdBoot: true})
	if err != nil || !resumed || got.EnvdAccessToken != sb.EnvdAccessToken || h.b.Instance(sb.ID) != inst || inst.Frozen() {
		t.Fatalf("cold connect: %v %v", resumed, err)
	}
	if h.file(sb.ID, "/f") != "kept" {
		t.Fatal("file lost")
	}
	if _, err := h.o.Snapshot(ctx, sb.ID, ""); !errors.Is(err, ErrUnsupported) || h.state(sb.ID) != StateRunning {
		t.Fatalf("snapshot = %v, state %q", err, h.state(sb.ID))
	}
	if _, err := h.o.Fork(ctx, sb.ID, 2, 0); !errors.Is(err, ErrUnsupported) || len(h.b.Live()) != 1 {
		t.Fatalf("fork = %v, live %v", err, h.b.Live())
	}
}
