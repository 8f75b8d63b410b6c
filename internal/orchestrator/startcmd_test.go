package orchestrator

import (
	"context"
	"encoding/base64"
	"slices"
	"testing"
	"time"

	"github.com/aenv-dev/aenv/internal/catalog"
	"github.com/aenv-dev/aenv/internal/sandbox"
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
