package orchestrator

import (
	"context"
	"encoding/base64"
	"slices"
	"testing"
	"time"

	"github.com/aenv-dev/aenv/internal/catalog"
	"github.com/aenv-dev/aenv/internal/sandbox"
	"github.com/aenv-dev/aenv/internal/sandbox/mock"
)

func TestRunsFreshProcesses(t *testing.T) {
	container := sandbox.Capabilities{Snapshots: true}
	vm := sandbox.Capabilities{Snapshots: true, MemorySnapshots: true}
	tests := []struct {
		name string
		plan sandbox.LaunchPlan
		caps sandbox.Capabilities
		want bool
	}{
		{"fresh", sandbox.LaunchPlan{Kind: sandbox.LaunchFresh}, vm, true},
		{"memory resume", sandbox.LaunchPlan{Kind: sandbox.LaunchResume}, container, false},
		{"container snapshot", sandbox.LaunchPlan{Kind: sandbox.LaunchFromSnapshot}, container, true},
		{"vm snapshot continues processes", sandbox.LaunchPlan{Kind: sandbox.LaunchFromSnapshot}, vm, false},
		{"vm cold boot", sandbox.LaunchPlan{Kind: sandbox.LaunchFromSnapshot, ColdBoot: true}, vm, true},
	}
	for _, tt := range tests {
		if got := runsFreshProcesses(tt.plan, tt.caps); got != tt.want {
			t.Errorf("%s: runsFreshProcesses = %v, want %v", tt.name, got, tt.want)
		}
	}
}

// A template's start command runs at create, is not run again when a memory pause is
// undone, and runs again when the sandbox boots fresh from a disk snapshot.
func TestTemplateStartCommand(t *testing.T) {
	ctx := context.Background()
	mode := snapModes[0] // container: freezer pause, disk snapshots without memory
	h := newHarness(t, mode.opts, nil)
	err := h.cat.Templates().Put(catalog.Template{ID: "web", Kind: catalog.KindTemplate, RootFSDir: "/srv/web",
		DefaultUser: "app", DefaultWorkdir: "/srv", StartCmd: "python3 -m http.server 8080"})
	if err != nil {
		t.Fatal(err)
	}
	sb := h.create(CreateRequest{TemplateID: "web", Secure: true, Timeout: time.Minute})
	starts := h.inst(sb.ID).Envd().Starts()
	if len(starts) != 1 {
		t.Fatalf("starts after create = %+v, want 1", starts)
	}
	s := starts[0]
	wantAuth := "Basic " + base64.StdEncoding.EncodeToString([]byte("app:"))
	if s.Cmd != "/bin/bash" || !slices.Equal(s.Args, []string{"-l", "-c", "python3 -m http.server 8080"}) ||
		s.Cwd != "/srv" || s.Tag != startCmdTag || s.Authorization != wantAuth || s.AccessToken != sb.EnvdAccessToken {
		t.Fatalf("start request = %+v", s)
	}

	if err := h.o.Pause(ctx, sb.ID, sandbox.PauseOptions{KeepMemory: true}); err != nil {
		t.Fatal(err)
	}
	if _, _, err := h.o.Connect(ctx, sb.ID, ConnectOptions{Timeout: time.Minute}); err != nil {
		t.Fatal(err)
	}
	if n := len(h.inst(sb.ID).Envd().Starts()); n != 1 {
		t.Fatalf("starts after a memory pause/resume = %d, want still 1", n)
	}

	if err := h.o.Pause(ctx, sb.ID, sandbox.PauseOptions{KeepMemory: false}); err != nil {
		t.Fatal(err)
	}
	if _, _, err := h.o.Connect(ctx, sb.ID, ConnectOptions{Timeout: time.Minute}); err != nil {
		t.Fatal(err)
	}
	if starts := h.inst(sb.ID).Envd().Starts(); len(starts) != 1 || starts[0].Tag != startCmdTag {
		t.Fatalf("starts on the instance booted from disk = %+v, want the start command once", starts)
	}

	// Templates without a start command start nothing.
	plain := h.create(CreateRequest{Timeout: time.Minute})
	if starts := h.inst(plain.ID).Envd().Starts(); len(starts) != 0 {
		t.Fatalf("starts for a template without a start command = %+v", starts)
	}
}

// After a node restart, the output of a start command still running in an adopted
// sandbox reaches its logs again (what ran while no node listened is lost), one that
// ended meanwhile gets its end logged, and one that ended before is left alone.
func TestStartCommandReattach(t *testing.T) {
	ctx := context.Background()
	h := newServeHarness(t, snapModes[0].opts, true)
	running := h.create(CreateRequest{TemplateID: "web", Timeout: time.Hour})
	endsUnseen := h.create(CreateRequest{TemplateID: "web", Timeout: time.Hour})
	ra, ea := h.inst(running.ID).Envd(), h.inst(endsUnseen.ID).Envd()
	const pid = 1 // each fake envd numbers its processes from 1
	hasLog := func(id, msg string) func() bool {
		return func() bool {
			es, err := h.o.Logs(ctx, id, LogQuery{Forward: true, Search: msg})
			return err == nil && len(es) > 0
		}
	}
	eventually(t, "first output captured", hasLog(running.ID, "out of -l -c serve"))

	// The node goes away: its streams close, the processes run on.
	if err := h.o.logs.stopFollowing(ctx); err != nil {
		t.Fatal(err)
	}
	eventually(t, "streams detached", func() bool { return ra.Attached(pid) == 0 && ea.Attached(pid) == 0 })
	ra.Emit(pid, "while down\n")
	ea.End(pid, 3)
	h.restart()

	eventually(t, "re-attached", func() bool { return ra.Attached(pid) == 1 })
	if c := ra.Connects(); len(c) != 1 || c[0].Pid != pid {
		t.Fatalf("connects = %+v, want one by pid %d", c, pid)
	}
	ra.Emit(pid, "after restart\n")
	ra.End(pid, 0)
	eventually(t, "output after the restart", hasLog(running.ID, "after restart"))
	eventually(t, "end after the restart", hasLog(running.ID, msgStartCmdEnded))
	if hasLog(running.ID, "while down")() {
		t.Error("output written while no node listened appeared in the logs")
	}
	if !hasLog(running.ID, msgStartCmdReattached)() {
		t.Error("no re-attach event in the logs")
	}
	eventually(t, "unseen end logged", func() bool {
		es, err := h.o.Logs(ctx, endsUnseen.ID, LogQuery{Search: msgStartCmdEnded, Limit: 1})
		return err == nil && len(es) == 1 && es[0].Level == LevelError && es[0].Fields["exitCode"] == "3"
	})

	// Both ended: a second restart re-attaches to nothing.
	h.restart()
	h.create(CreateRequest{TemplateID: "web", Timeout: time.Hour}) // lets the adoption's goroutines run
	if n, m := len(ra.Connects()), len(ea.Connects()); n != 1 || m != 1 {
		t.Fatalf("connects after a restart with no start command running = %d, %d, want still 1, 1", n, m)
	}
}

// A sandbox paused in place when the node went away has its start command's output
// re-attached when it is resumed; a pause and resume on the same node keeps the capture
// it has.
func TestStartCommandReattachOnResume(t *testing.T) {
	ctx := context.Background()
	h := newServeHarness(t, snapModes[0].opts, true) // pause freezes in place
	sb := h.create(CreateRequest{TemplateID: "web", Timeout: time.Hour})
	env := h.inst(sb.ID).Envd()
	const pid = 1
	eventually(t, "capture", func() bool { return env.Attached(pid) == 1 })
	pauseAndResume(t, h, sb.ID)
	if c := env.Connects(); len(c) != 0 || env.Attached(pid) != 1 {
		t.Fatalf("a resume on the same node re-attached: connects %+v, %d streams", c, env.Attached(pid))
	}

	if err := h.o.Pause(ctx, sb.ID, sandbox.PauseOptions{KeepMemory: true}); err != nil {
		t.Fatal(err)
	}
	if err := h.o.logs.stopFollowing(ctx); err != nil {
		t.Fatal(err)
	}
	eventually(t, "detached", func() bool { return env.Attached(pid) == 0 })
	h.restart()
	if c := env.Connects(); len(c) != 0 {
		t.Fatalf("a paused sandbox was re-attached at start: %+v", c)
	}
	if _, _, err := h.o.Connect(ctx, sb.ID, ConnectOptions{Timeout: time.Minute}); err != nil {
		t.Fatal(err)
	}
	eventually(t, "re-attached on resume", func() bool { return env.Attached(pid) == 1 })
	env.Emit(pid, "after resume\n")
	eventually(t, "output after the resume", func() bool {
		es, err := h.o.Logs(ctx, sb.ID, LogQuery{Search: "after resume"})
		return err == nil && len(es) == 1
	})
}

// A start command envd no longer knows when its output is re-attached (a VM resumed from
// memory whose process ended unseen) is logged as gone once, and not asked for again.
func TestStartCommandReattachGone(t *testing.T) {
	ctx := context.Background()
	h := newServeHarness(t, snapModes[1].opts, true) // vm: pause stops the instance, resume keeps processes
	sb := h.create(CreateRequest{TemplateID: "web", Timeout: time.Hour})
	pauseAndResume(t, h, sb.ID)
	// The fake envd of the resumed instance knows no process: the attach is refused.
	gone := func() bool {
		es, err := h.o.Logs(ctx, sb.ID, LogQuery{Search: msgStartCmdGone})
		return err == nil && len(es) == 1
	}
	if !waitUntil(5*time.Second, gone) {
		all, err := h.o.Logs(ctx, sb.ID, LogQuery{})
		t.Fatalf("the start command was not logged as gone; the sandbox's logs (%v):\n%+v", err, all)
	}
	if c := h.inst(sb.ID).Envd().Connects(); len(c) != 1 || c[0].Pid != 1 {
		t.Fatalf("connects = %+v, want one by pid 1", c)
	}
	pauseAndResume(t, h, sb.ID)
	h.create(CreateRequest{TemplateID: "base", Timeout: time.Hour})
	if c := h.inst(sb.ID).Envd().Connects(); len(c) != 0 {
		t.Fatalf("re-attached again to a start command known gone: %+v", c)
	}
}

func TestStartCommandPid(t *testing.T) {
	ev := func(msg, pid string) LogEntry {
		return LogEntry{Level: LevelInfo, Message: msg, Fields: map[string]string{"pid": pid}}
	}
	tests := []struct {
		name    string
		entries []LogEntry
		pid     uint32
		running bool
	}{
		{"no record", nil, 0, true},
		{"started", []LogEntry{ev(msgStartCmdStarted, "7"), ev("output", "")}, 7, true},
		{"ended", []LogEntry{ev(msgStartCmdStarted, "7"), ev(msgStartCmdEnded, "")}, 0, false},
		{"started again", []LogEntry{ev(msgStartCmdStarted, "7"), ev(msgStartCmdEnded, ""), ev(msgStartCmdStarted, "9")}, 9, true},
		{"re-attached", []LogEntry{ev(msgStartCmdEnded, ""), ev(msgStartCmdReattached, "4")}, 4, true},
		{"bad pid", []LogEntry{ev(msgStartCmdStarted, "x")}, 0, true},
		{"gone", []LogEntry{ev(msgStartCmdStarted, "7"), ev(msgStartCmdGone, "")}, 0, false},
	}
	for _, tt := range tests {
		s := newLogStore(t.TempDir())
		if len(tt.entries) > 0 {
			if err := s.add("sb", tt.entries...); err != nil {
				t.Fatal(err)
			}
		}
		if pid, running := s.startCommandPid("sb"); pid != tt.pid || running != tt.running {
			t.Errorf("%s: startCommandPid = %d, %v, want %d, %v", tt.name, pid, running, tt.pid, tt.running)
		}
	}
}

// newServeHarness is a harness whose catalog has template "web" with start command
// "serve"; hold keeps the fake envd's processes running (mock.Options.HoldStartCommands).
func newServeHarness(t *testing.T, opts mock.Options, hold bool) *harness {
	t.Helper()
	opts.HoldStartCommands = hold
	h := newHarness(t, opts, nil)
	if err := h.cat.Templates().Put(catalog.Template{ID: "web", Kind: catalog.KindTemplate, RootFSDir: "/srv/web",
		StartCmd: "serve"}); err != nil {
		t.Fatal(err)
	}
	return h
}

// pauseAndResume pauses sandbox id keeping its memory and resumes it.
func pauseAndResume(t *testing.T, h *harness, id string) {
	t.Helper()
	ctx := context.Background()
	if err := h.o.Pause(ctx, id, sandbox.PauseOptions{KeepMemory: true}); err != nil {
		t.Fatal(err)
	}
	if _, _, err := h.o.Connect(ctx, id, ConnectOptions{Timeout: time.Minute}); err != nil {
		t.Fatal(err)
	}
}
