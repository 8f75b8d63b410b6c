package vmm_test

import (
	"context"
	"crypto/sha256"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"strconv"
	"sync"
	"testing"
	"time"

	"github.com/aenv-dev/aenv/internal/vmm"
)

func fileHash(t testing.TB, p string) string {
	t.Helper()
	f, err := os.Open(p)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	h := sha256.New()
	if _, err := io.Copy(h, f); err != nil {
		t.Fatal(err)
	}
	return fmt.Sprintf("%x", h.Sum(nil))
}

// TestLifecycle boots a guest on a shared RAM file, pauses and resumes it, snapshots its
// device state, then restores four copy-on-write forks of the RAM file: each continues
// the counter from the saved value, each keeps its own memory, the template file never
// changes, and every QEMU is gone after Kill.
func TestLifecycle(t *testing.T) {
	g := newGuest(t)
	dir, shm := t.TempDir(), shmDir(t)
	ctx := context.Background()
	ram := filepath.Join(shm, "template.ram")

	src := start(t, g.config(t, dir, "src", ram, true))
	waitCounts(t, src, 3, 60*time.Second)
	if got := get(t, hostPort(src.Config()), "/cgi-bin/mark?template", 10*time.Second); got != "template" {
		t.Fatalf("template mark = %q", got)
	}

	// Pause: the counter stops; resume: it goes on.
	if err := src.Pause(ctx); err != nil {
		t.Fatal(err)
	}
	if st, err := src.Status(ctx); err != nil || st != "paused" {
		t.Fatalf("status after pause = %q, %v", st, err)
	}
	before := len(counts(t, src.Config().ConsoleLog))
	time.Sleep(400 * time.Millisecond)
	if after := len(counts(t, src.Config().ConsoleLog)); after != before {
		t.Fatalf("counter advanced while paused: %d -> %d lines", before, after)
	}
	if err := src.Resume(ctx); err != nil {
		t.Fatal(err)
	}
	waitCounts(t, src, before+2, 10*time.Second)

	// Snapshot: device state only, RAM stays in the shared file.
	state, err := src.SaveDeviceState(ctx, filepath.Join(dir, "template.state"))
	if err != nil {
		t.Fatal(err)
	}
	if !state.IgnoreShared || state.Size == 0 || state.Size > 1<<20 {
		t.Fatalf("device state = %+v, want a small stream without RAM", state)
	}
	saved := counts(t, src.Config().ConsoleLog)
	last := saved[len(saved)-1]
	if err := src.Stop(ctx); err != nil {
		t.Fatal(err)
	}
	if !processGone(src.PID()) {
		t.Fatalf("QEMU %d still exists after Stop", src.PID())
	}
	if err := vmm.MarkTemplate(ram); err != nil {
		t.Fatal(err)
	}
	hash := fileHash(t, ram)

	// A read-only template must not be mapped shared.
	if _, err := vmm.Start(ctx, g.config(t, dir, "bad", ram, true)); err == nil {
		t.Fatal("Start mapped a template RAM file shared")
	}

	const forks = 4
	ms := make([]*vmm.Machine, forks)
	var wg sync.WaitGroup
	errs := make([]error, forks)
	for i := range forks {
		cfg := g.config(t, dir, fmt.Sprintf("fork%d", i), ram, false)
		wg.Add(1)
		go func() {
			defer wg.Done()
			rctx, cancel := context.WithTimeout(ctx, 60*time.Second)
			defer cancel()
			ms[i], errs[i] = vmm.Restore(rctx, cfg, state)
		}()
	}
	wg.Wait()
	for i, m := range ms {
		if errs[i] != nil {
			t.Fatalf("fork %d: %v", i, errs[i])
		}
		t.Cleanup(m.Kill)
	}
	for i, m := range ms {
		c := waitCounts(t, m, 2, 30*time.Second)
		if c[0] != last+1 {
			t.Errorf("fork %d: counter resumed at %d, want %d", i, c[0], last+1)
		}
		port := hostPort(m.Config())
		if got := get(t, port, "/mark", 20*time.Second); got != "template" {
			t.Errorf("fork %d: inherited mark = %q, want template", i, got)
		}
		if got := get(t, port, "/cgi-bin/mark?fork"+strconv.Itoa(i), 10*time.Second); got != "fork"+strconv.Itoa(i) {
			t.Errorf("fork %d: set mark = %q", i, got)
		}
	}
	for i, m := range ms {
		if got := get(t, hostPort(m.Config()), "/mark", 10*time.Second); got != "fork"+strconv.Itoa(i) {
			t.Errorf("fork %d: mark = %q after all forks wrote theirs: memory is not private", i, got)
		}
	}

	// A fork re-templated: full stream (its RAM is private), loaded onto a fresh shared file.
	full, err := ms[0].SaveFull(ctx, filepath.Join(dir, "fork0.full"))
	if err != nil {
		t.Fatal(err)
	}
	if full.IgnoreShared || full.Size < 1<<20 {
		t.Fatalf("full state = %+v, want RAM in the stream", full)
	}
	fc := counts(t, ms[0].Config().ConsoleLog)
	retpl, err := vmm.Restore(ctx, g.config(t, dir, "retemplate", filepath.Join(shm, "retemplate.ram"), true), full)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(retpl.Kill)
	if c := waitCounts(t, retpl, 1, 30*time.Second); c[0] != fc[len(fc)-1]+1 {
		t.Errorf("re-templated fork resumed at %d, want %d", c[0], fc[len(fc)-1]+1)
	}
	if got := get(t, hostPort(retpl.Config()), "/mark", 20*time.Second); got != "fork0" {
		t.Errorf("re-templated fork mark = %q, want fork0", got)
	}

	for _, m := range append(ms, retpl) {
		m.Kill()
		if !processGone(m.PID()) {
			t.Errorf("QEMU %d still exists after Kill", m.PID())
		}
	}
	if got := fileHash(t, ram); got != hash {
		t.Error("the template RAM file changed while forks mapped it")
	}
}

// TestKillPIDFile ends a QEMU the way a restarted node does: from its pidfile only.
func TestKillPIDFile(t *testing.T) {
	g := newGuest(t)
	dir, shm := t.TempDir(), shmDir(t)
	m := start(t, g.config(t, dir, "orphan", filepath.Join(shm, "ram"), true))
	pidfile := m.Config().PIDFile
	if err := vmm.KillPIDFile(pidfile); err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if err := m.Wait(ctx); err == nil || ctx.Err() != nil {
		t.Fatalf("QEMU not killed: wait = %v", err)
	}
	if !processGone(m.PID()) {
		t.Fatalf("QEMU %d still exists", m.PID())
	}
	// A pidfile naming another process is ignored.
	if err := os.WriteFile(pidfile, []byte(strconv.Itoa(os.Getpid())), 0o644); err != nil {
		t.Fatal(err)
	}
	if err := vmm.KillPIDFile(pidfile); err != nil {
		t.Fatal(err)
	}
}

// TestStartFailureLeavesNothing: a QEMU that rejects its configuration reports why and
// leaves no process behind.
func TestStartFailureLeavesNothing(t *testing.T) {
	g := newGuest(t)
	dir, shm := t.TempDir(), shmDir(t)
	cfg := g.config(t, dir, "bad", filepath.Join(shm, "ram"), true)
	cfg.Drives = []vmm.Drive{{ID: "root", Path: filepath.Join(dir, "missing.img")}}
	_, err := vmm.Start(context.Background(), cfg)
	if err == nil {
		t.Fatal("Start succeeded with a missing drive file")
	}
	t.Log(err)
	if pids := processesMentioning(t, dir); len(pids) > 0 {
		t.Fatalf("QEMU processes left: %v", pids)
	}
}

// TestAccelProbe: the probe answers, and on a host whose /dev/kvm cannot boot a stock
// kernel it answers TCG within its timeout instead of hanging.
func TestAccelProbe(t *testing.T) {
	g := newGuest(t)
	p := &vmm.AccelProbe{Timeout: 10 * time.Second}
	t0 := time.Now()
	a, err := p.Detect(context.Background(), "", g.kernel.Vmlinux(), t.TempDir())
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("accelerator %s after %v", a, time.Since(t0))
	if b, err := p.Detect(context.Background(), "", g.kernel.Vmlinux(), t.TempDir()); err != nil || b != a {
		t.Fatalf("second probe = %s, %v; want cached %s", b, err, a)
	}
}

// TestBootProbe runs the accelerator probe's boot under TCG: it boots to its panic within
// a generous timeout, and a timeout too short to boot answers "no" and leaves no QEMU
// (what happens on a /dev/kvm that hangs).
func TestBootProbe(t *testing.T) {
	g := newGuest(t)
	dir := t.TempDir()
	ok, why, err := vmm.BootProbe(context.Background(), vmm.AccelTCG, "", g.kernel.Vmlinux(), dir, 60*time.Second)
	if err != nil || !ok {
		t.Fatalf("TCG probe boot = %v, %q, %v", ok, why, err)
	}
	ok, why, err = vmm.BootProbe(context.Background(), vmm.AccelTCG, "", g.kernel.Vmlinux(), dir, 300*time.Millisecond)
	if err != nil || ok {
		t.Fatalf("probe with a 300 ms timeout = %v, %q, %v; want a timeout", ok, why, err)
	}
	t.Log(why)
	if pids := processesMentioning(t, dir); len(pids) > 0 {
		t.Fatalf("probe QEMU left running: %v", pids)
	}
}
