package microvm

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/aenv-dev/aenv/internal/sandbox"
)

// TestLaunchRunStop boots a sandbox from the layered base template, runs commands through
// envd, checks what the guest is (its kernel, address, hostname, resources) and that Stop
// leaves nothing and is idempotent.
func TestLaunchRunStop(t *testing.T) {
	b := newTestBackend(t)
	i := launch(t, b, "sbx-run", sandbox.Resources{CPUCount: 2, MemoryMB: 160, DiskSizeMB: 512})
	// Without it one TCG boot in five hangs calibrating the TSC.
	if args, _ := os.ReadFile(fmt.Sprintf("/proc/%d/cmdline", i.PID())); !strings.Contains(string(args), "tsc_early_khz=") {
		t.Errorf("QEMU command line lacks tsc_early_khz: %q", args)
	}
	kver, err := os.ReadFile(filepath.Join(repoRoot(), "bin", "microvm", "kernel-version"))
	if err != nil {
		t.Fatal(err)
	}
	out := mustSh(t, i, `uname -r; hostname; nproc; awk '/MemTotal/{print int($2/1024)}' /proc/meminfo
ip -4 -o addr show eth0 | awk '{print $4}'; df -m / | awk 'NR==2{print $2}'; echo $$ > /dev/null; cat /proc/1/comm`)
	f := strings.Fields(out)
	if len(f) != 7 {
		t.Fatalf("guest facts: %q", out)
	}
	if f[0] != strings.TrimSpace(string(kver)) {
		t.Errorf("kernel %s, want %s", f[0], kver)
	}
	if f[1] != "sbx-run" {
		t.Errorf("hostname %s", f[1])
	}
	if f[2] != "2" {
		t.Errorf("nproc %s, want 2", f[2])
	}
	if f[3] < "100" || len(f[3]) != 3 {
		t.Errorf("MemTotal %s MiB for a 160 MiB guest", f[3])
	}
	if ep := i.Endpoint(); !strings.HasPrefix(f[4], ep.Host+"/") {
		t.Errorf("guest address %s, slot address %s", f[4], ep.Host)
	}
	if len(f[5]) < 3 || f[5] < "400" {
		t.Errorf("root filesystem %s MiB, want it grown to ~512", f[5])
	}
	if f[6] != "envd" {
		t.Errorf("PID 1 is %s, want envd", f[6])
	}
	if _, _, code := sh(t, i, "exit 7"); code != 7 {
		t.Errorf("exit code %d, want 7", code)
	}
	// The guest clock follows envd's /init timestamp forward (as after a restore).
	ahead := time.Now().Add(time.Hour).UTC()
	postInit(t, i, map[string]any{"timestamp": ahead})
	guest, _ := strconv.ParseInt(strings.TrimSpace(mustSh(t, i, "date +%s")), 10, 64)
	if d := guest - ahead.Unix(); d < -2 || d > 60 {
		t.Errorf("guest clock %d, /init set it to %d", guest, ahead.Unix())
	}
	st, err := i.Stats(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	if st.MemTotal != 160<<20 || st.MemUsed <= 0 || st.DiskTotal != 512<<20 {
		t.Errorf("stats %+v", st)
	}

	slot := i.slot
	pid := i.PID()
	ctx := context.Background()
	if err := i.Stop(ctx); err != nil {
		t.Fatal(err)
	}
	if err := i.Stop(ctx); err != nil {
		t.Fatalf("second stop: %v", err)
	}
	if alive(pid) {
		t.Errorf("QEMU %d still exists", pid)
	}
	if _, err := os.Stat(slot.NetnsPath); err == nil {
		t.Errorf("netns %s left", slot.NetnsPath)
	}
	if _, err := i.Stats(ctx); !errors.Is(err, sandbox.ErrGone) {
		t.Errorf("stats after stop: %v, want ErrGone", err)
	}
	assertClean(t, b)
}

// TestLaunchRejects checks that bad plans get a clear error and change nothing.
func TestLaunchRejects(t *testing.T) {
	b := newTestBackend(t)
	ok := sandbox.LaunchPlan{Kind: sandbox.LaunchFresh, SandboxID: "x", RootFS: fix.template}
	tests := []struct {
		name        string
		mod         func(p *sandbox.LaunchPlan)
		unsupported bool
	}{
		{"bad id", func(p *sandbox.LaunchPlan) { p.SandboxID = "../x" }, false},
		{"negative memory", func(p *sandbox.LaunchPlan) { p.Resources.MemoryMB = -1 }, false},
		{"directory template", func(p *sandbox.LaunchPlan) { p.RootFS = sandbox.RootFS{LowerDir: "/"} }, true},
		{"relative layer", func(p *sandbox.LaunchPlan) { p.RootFS.Layers = []sandbox.LayerRef{{Path: "x.commit"}} }, false},
		{"digest without resolver", func(p *sandbox.LaunchPlan) { p.RootFS.Layers = []sandbox.LayerRef{{Digest: "sha256:00"}} }, false},
		{"from snapshot without a capture", func(p *sandbox.LaunchPlan) { p.Kind = sandbox.LaunchFromSnapshot }, false},
		{"resume without a paused state", func(p *sandbox.LaunchPlan) { p.Kind = sandbox.LaunchResume }, false},
		{"unknown kind", func(p *sandbox.LaunchPlan) { p.Kind = 42 }, false},
		{"missing layer file", func(p *sandbox.LaunchPlan) { p.RootFS.Layers = []sandbox.LayerRef{{Path: "/nonexistent.commit"}} }, false},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			p := ok
			tt.mod(&p)
			inst, err := b.Launch(context.Background(), p)
			if err == nil {
				inst.Stop(context.Background())
				t.Fatal("accepted")
			}
			if errors.Is(err, sandbox.ErrUnsupported) != tt.unsupported {
				t.Errorf("error %v: ErrUnsupported = %v, want %v", err, !tt.unsupported, tt.unsupported)
			}
			assertClean(t, b)
		})
	}
}
