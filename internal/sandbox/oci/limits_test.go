package oci

import (
	"context"
	"errors"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/aenv-dev/aenv/internal/sandbox"
)

// oomKills reads the kernel's count of OOM kills in the sandbox's memory cgroup.
func oomKills(t *testing.T, b *Backend, id string) int64 {
	t.Helper()
	var m map[string]int64
	var err error
	if b.v2 {
		m, err = readKeyed(filepath.Join(cgroupRoot, b.cgroupsPath(id), "memory.events"))
	} else {
		m, err = readKeyed(filepath.Join(cgroupRoot, "memory", b.cgroupsPath(id), "memory.oom_control"))
	}
	if err != nil {
		t.Fatal(err)
	}
	return m["oom_kill"]
}

func TestMemoryHogOOMKilledInsideCgroup(t *testing.T) {
	e := newTestBackend(t, nil)
	i := e.launch(t, "oom1", sandbox.Resources{CPUCount: 1, MemoryMB: 64})
	if n := oomKills(t, e.b, i.id); n != 0 {
		t.Fatalf("oom kills before the hog: %d", n)
	}
	// dd allocates and fills a 256 MiB buffer: four times the limit.
	out, code := e.sh(t, i, "dd if=/dev/zero of=/dev/null bs=256M count=1; echo dd=$?")
	if !strings.Contains(out, "dd=137") {
		t.Fatalf("hog not killed (exit %d): %s", code, out)
	}
	if n := oomKills(t, e.b, i.id); n < 1 {
		t.Fatalf("no OOM kill recorded in the sandbox's cgroup")
	}
	// Only the hog died: the sandbox's init still serves.
	if err := probeHealth(i, 2*time.Second); err != nil {
		t.Fatalf("init died with the hog: %v", err)
	}
	st, err := i.Stats(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	if st.MemUsed > 64<<20 {
		t.Fatalf("memory use %d above the limit", st.MemUsed)
	}
}

func TestForkBombStoppedByPidsLimit(t *testing.T) {
	e := newTestBackend(t, func(c *Config) { c.PidsLimit = 64 })
	i := e.launch(t, "bomb1", sandbox.Resources{CPUCount: 1, MemoryMB: 256})
	e.sh(t, i, "/bin/bash -c 'b(){ b | b & }; b' >/dev/null 2>&1 &")
	pidsDir := filepath.Join(cgroupRoot, "pids", e.b.cgroupsPath(i.id))
	if e.b.v2 {
		pidsDir = filepath.Join(cgroupRoot, e.b.cgroupsPath(i.id))
	}
	deadline := time.Now().Add(20 * time.Second)
	for {
		ev, err := readKeyed(filepath.Join(pidsDir, "pids.events"))
		if err != nil {
			t.Fatal(err)
		}
		if ev["max"] > 0 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatal("fork bomb never hit the pids limit")
		}
		time.Sleep(50 * time.Millisecond)
	}
	cur, err := readInt(filepath.Join(pidsDir, "pids.current"))
	if err != nil {
		t.Fatal(err)
	}
	if cur > 64 {
		t.Fatalf("pids.current %d above the limit 64", cur)
	}
	// Stop must kill the whole bomb and leave nothing.
	slot := traceSlot(t, i.slot)
	if err := i.Stop(context.Background()); err != nil {
		t.Fatal(err)
	}
	assertGone(t, e.b, i.cid, slot)
}

func TestPauseResume(t *testing.T) {
	e := newTestBackend(t, nil)
	ctx := context.Background()
	i := e.launch(t, "pause1", sandbox.Resources{CPUCount: 1, MemoryMB: 128})
	e.sh(t, i, "echo before > /root/state")
	ps, err := i.Pause(ctx, sandbox.PauseOptions{KeepMemory: true})
	if err != nil {
		t.Fatal(err)
	}
	if st, _ := i.Status(ctx); st != "paused" {
		t.Fatalf("status %q after pause", st)
	}
	if err := probeHealth(i, 300*time.Millisecond); err == nil {
		t.Fatal("a paused sandbox answered")
	}
	if _, err := i.Pause(ctx, sandbox.PauseOptions{}); err != nil {
		t.Fatalf("second pause: %v", err)
	}
	if _, err := i.Stats(ctx); err != nil {
		t.Fatalf("stats while paused: %v", err)
	}
	raw, err := ps.Encode()
	if err != nil {
		t.Fatal(err)
	}
	dec, err := e.b.DecodePaused(raw)
	if err != nil {
		t.Fatal(err)
	}
	// Resume through the backend, as the orchestrator does.
	again, err := e.b.Launch(ctx, sandbox.LaunchPlan{Kind: sandbox.LaunchResume, SandboxID: i.id, Paused: dec})
	if err != nil {
		t.Fatal(err)
	}
	if again != i {
		t.Fatal("resume returned another instance")
	}
	e.waitReady(t, i)
	if out, _ := e.sh(t, i, "cat /root/state"); out != "before\n" {
		t.Fatalf("state lost across pause: %q", out)
	}
	if err := i.Resume(ctx); err != nil {
		t.Fatalf("resume of a running sandbox: %v", err)
	}
	// Stop works on a paused sandbox too.
	if _, err := i.Pause(ctx, sandbox.PauseOptions{}); err != nil {
		t.Fatal(err)
	}
	slot := traceSlot(t, i.slot)
	if err := i.Stop(ctx); err != nil {
		t.Fatal(err)
	}
	assertGone(t, e.b, i.cid, slot)
	if err := i.Resume(ctx); !errors.Is(err, sandbox.ErrGone) {
		t.Fatalf("resume after stop: %v", err)
	}
}

func TestLaunchBadInput(t *testing.T) {
	e := newTestBackend(t, nil)
	ctx := context.Background()
	ok := sandbox.LaunchPlan{Kind: sandbox.LaunchFresh, SandboxID: "bad0", RootFS: sandbox.RootFS{LowerDir: e.template}}
	tests := []struct {
		name string
		mod  func(*sandbox.LaunchPlan)
		want error
	}{
		{"empty id", func(p *sandbox.LaunchPlan) { p.SandboxID = "" }, nil},
		{"path id", func(p *sandbox.LaunchPlan) { p.SandboxID = "../x" }, nil},
		{"no rootfs", func(p *sandbox.LaunchPlan) { p.RootFS.LowerDir = "" }, nil},
		{"missing rootfs", func(p *sandbox.LaunchPlan) { p.RootFS.LowerDir = "/nonexistent/rootfs" }, nil},
		{"negative memory", func(p *sandbox.LaunchPlan) { p.Resources.MemoryMB = -1 }, nil},
		{"snapshot without capture", func(p *sandbox.LaunchPlan) { p.Kind = sandbox.LaunchFromSnapshot }, nil},
		{"missing layer", func(p *sandbox.LaunchPlan) {
			p.RootFS.Layers = []sandbox.LayerRef{{Path: "/nonexistent/layer.commit"}}
		}, nil},
		{"relative layer", func(p *sandbox.LaunchPlan) { p.RootFS.Layers = []sandbox.LayerRef{{Path: "layer.commit"}} }, nil},
		{"resume unknown", func(p *sandbox.LaunchPlan) { p.Kind = sandbox.LaunchResume }, sandbox.ErrGone},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			p := ok
			tc.mod(&p)
			_, err := e.b.Launch(ctx, p)
			if err == nil || (tc.want != nil && !errors.Is(err, tc.want)) {
				t.Fatalf("err %v, want %v", err, tc.want)
			}
		})
	}
	ents, _ := os.ReadDir(filepath.Join(e.cfg.DataDir, "sandboxes"))
	if len(ents) != 0 {
		t.Fatalf("rejected launches left bundles: %v", ents)
	}
	// A duplicate id is refused and does not disturb the first sandbox.
	i := e.launch(t, "dup1", sandbox.Resources{})
	p := ok
	p.SandboxID = "dup1"
	if _, err := e.b.Launch(ctx, p); !errors.Is(err, ErrExists) {
		t.Fatalf("duplicate: %v", err)
	}
	if err := probeHealth(i, time.Second); err != nil {
		t.Fatalf("first sandbox hurt by duplicate launch: %v", err)
	}
	// A launch whose init cannot start cleans up after itself.
	bad := newTestBackend(t, func(c *Config) {
		c.InitArgs = []string{"/does/not/exist"}
		c.Network.Bridge, c.Network.Prefix, c.Network.Subnet = "aenvocit1", "aenvou", "10.89.17.0/24"
	})
	p = ok
	p.SandboxID = "fail1"
	if _, err := bad.b.Launch(ctx, p); err == nil {
		t.Fatal("launch with a missing init succeeded")
	}
	assertGone(t, bad.b, "fail1", nil)
}
