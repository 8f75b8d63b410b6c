package microvm

import (
	"bufio"
	"context"
	"encoding/json"
	"fmt"
	"os"
	"os/exec"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/aenv-dev/aenv/internal/sandbox"
)

// crashChildEnv makes the test binary a node that launches one sandbox, reports it and
// waits to be killed.
const crashChildEnv = "AENV_MICROVM_CRASH_CHILD"

type crashSpec struct {
	Config   Config         `json:"config"`
	Template sandbox.RootFS `json:"template"`
	ID       string         `json:"id"`
}

func crashChild(raw string) error {
	var spec crashSpec
	if err := json.Unmarshal([]byte(raw), &spec); err != nil {
		return err
	}
	ctx := context.Background()
	b, err := New(ctx, spec.Config)
	if err != nil {
		return err
	}
	if _, err := b.Reconcile(ctx, nil); err != nil {
		return err
	}
	inst, err := b.Launch(ctx, sandbox.LaunchPlan{Kind: sandbox.LaunchFresh, SandboxID: spec.ID, RootFS: spec.Template})
	if err != nil {
		return err
	}
	if err := envdReady(inst.(*Instance), 60*time.Second); err != nil {
		return err
	}
	fmt.Printf("READY %d\n", inst.(*Instance).PID())
	select {}
}

// TestReconcileAfterNodeKill kills a node (SIGKILL) with a running VM, then checks that a
// new backend's Reconcile kills the VM's QEMU and removes its disk mount, tap, slot, RAM
// file and directory.
func TestReconcileAfterNodeKill(t *testing.T) {
	needVM(t)
	fixtures(t)
	cfg := testConfig(t)
	spec, err := json.Marshal(crashSpec{Config: cfg, Template: fix.template, ID: "crashed"})
	if err != nil {
		t.Fatal(err)
	}
	child := exec.Command(os.Args[0], "-test.run=^$")
	child.Env = append(os.Environ(), crashChildEnv+"="+string(spec))
	child.Stderr = os.Stderr
	out, err := child.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := child.Start(); err != nil {
		t.Fatal(err)
	}
	line, err := bufio.NewReader(out).ReadString('\n')
	if err != nil || !strings.HasPrefix(line, "READY ") {
		child.Process.Kill()
		child.Wait()
		t.Fatalf("child: %q %v", line, err)
	}
	qemu, _ := strconv.Atoi(strings.TrimSpace(strings.TrimPrefix(line, "READY ")))
	if err := child.Process.Kill(); err != nil {
		t.Fatal(err)
	}
	child.Wait()
	if !alive(qemu) {
		t.Fatalf("QEMU %d died with the node; it should outlive it", qemu)
	}

	ctx := context.Background()
	b, err := New(ctx, cfg)
	if err != nil {
		t.Fatal(err)
	}
	alive, err := b.Reconcile(ctx, []string{"crashed"})
	if err != nil {
		t.Fatal(err)
	}
	if len(alive) != 0 {
		t.Errorf("adopted %v; a VM whose disk server died cannot be", alive)
	}
	if isQEMU(qemu) {
		t.Errorf("QEMU %d still runs after Reconcile", qemu)
	}
	if err := b.pool.Teardown(ctx); err != nil {
		t.Error(err)
	}
	assertClean(t, b)
	// The backend works after the sweep.
	b2 := newTestBackend(t)
	i := launch(t, b2, "after-crash", sandbox.Resources{})
	if err := i.Stop(ctx); err != nil {
		t.Fatal(err)
	}
}

func alive(pid int) bool {
	_, err := os.Stat("/proc/" + strconv.Itoa(pid))
	return err == nil
}

func isQEMU(pid int) bool {
	raw, err := os.ReadFile("/proc/" + strconv.Itoa(pid) + "/cmdline")
	return err == nil && strings.Contains(string(raw), "qemu")
}
