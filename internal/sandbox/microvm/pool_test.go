package microvm

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"net/http"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/aenv-dev/aenv/internal/dataplane"
	"github.com/aenv-dev/aenv/internal/envdclient"
	"github.com/aenv-dev/aenv/internal/sandbox"
)

// poolReady waits until the pool holds n stopped VMs of capture id.
func poolReady(t testing.TB, b *Backend, id string, n int) {
	t.Helper()
	deadline := time.Now().Add(3 * time.Minute)
	for {
		b.vmpool.mu.Lock()
		got := 0
		if sp := b.vmpool.snaps[id]; sp != nil {
			got = len(sp.ready)
		}
		b.vmpool.mu.Unlock()
		if got >= n {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("snapshot pool of %s holds %d VMs after 3 min, want %d", id, got, n)
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// pooledDirs lists the pooled VMs' directories.
func pooledDirs(b *Backend) []string {
	ents, _ := os.ReadDir(b.cfg.sandboxesDir())
	var out []string
	for _, e := range ents {
		if pooledDir(e.Name()) {
			out = append(out, e.Name())
		}
	}
	return out
}

// initEnvd does what the orchestrator does after every launch: POST /init with the
// sandbox's token, environment and the clock.
func initEnvd(t testing.TB, i *Instance, held, token string, env map[string]string, now time.Time) {
	t.Helper()
	if err := initEnvdErr(i, held, token, env, now); err != nil {
		t.Fatal(err)
	}
}

func initEnvdErr(i *Instance, held, token string, env map[string]string, now time.Time) error {
	body, _ := json.Marshal(map[string]any{"envVars": env, "accessToken": token, "timestamp": now.UTC().Format(time.RFC3339Nano)})
	ep := i.Endpoint()
	req, _ := http.NewRequest(http.MethodPost, fmt.Sprintf("http://%s:%d/init", ep.Host, ep.EnvdPort), bytes.NewReader(body))
	req.Header.Set("Content-Type", "application/json")
	if held != "" {
		req.Header.Set("X-Access-Token", held)
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		return fmt.Errorf("init %s: %w", i.id, err)
	}
	resp.Body.Close()
	if resp.StatusCode/100 != 2 {
		return fmt.Errorf("init %s: %s", i.id, resp.Status)
	}
	return nil
}

// shToken runs a script through envd with an access token; it returns stdout or an error
// (a refused token is an error).
func shToken(i *Instance, token, script string) (string, error) {
	ep := i.Endpoint()
	c := envdclient.New(http.DefaultClient, fmt.Sprintf("http://%s:%d", ep.Host, ep.EnvdPort), envdclient.WithAccessToken(token))
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

// TestSnapshotPool: a snapshot starts its pool; creates from it are pooled VMs handed out under their own ids, each
// continuing the counter process from its snapshot value, taking its own token,
// environment and clock at /init; the pool refills; discarding the snapshot stops every
// pooled VM that was not handed out.
func TestSnapshotPool(t *testing.T) {
	b := newTestBackend(t, func(c *Config) { c.SnapshotPool = 2 })
	ctx := context.Background()
	src := launch(t, b, "sbx-psrc", sandbox.Resources{CPUCount: 1, MemoryMB: testMemMB, DiskSizeMB: templateMB})
	pid := strings.TrimSpace(mustSh(t, src, counterScript))
	time.Sleep(time.Second)
	_, _, before := counterState(t, src)
	c, err := src.Snapshot(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if err := src.Stop(ctx); err != nil {
		t.Fatal(err)
	}
	cid := c.(*capture).ID
	// The snapshot starts its pool; a launch meanwhile restores as usual.
	first, err := b.Launch(ctx, sandbox.LaunchPlan{Kind: sandbox.LaunchFromSnapshot, SandboxID: "sbx-p0", Snapshot: c, AllowInternet: true})
	if err != nil {
		t.Fatal(err)
	}
	waitEnvd(t, first.(*Instance))
	poolReady(t, b, cid, 2)

	tokens := map[string]string{}
	for k := 1; k <= 2; k++ {
		id := fmt.Sprintf("sbx-p%d", k)
		t0 := time.Now()
		got, err := b.Launch(ctx, sandbox.LaunchPlan{Kind: sandbox.LaunchFromSnapshot, SandboxID: id, Snapshot: c, AllowInternet: k == 1})
		if err != nil {
			t.Fatal(err)
		}
		inst := got.(*Instance)
		if err := envdReady(inst, 30*time.Second); err != nil {
			t.Fatal(err)
		}
		t.Logf("%s: pooled launch → envd answering in %v", id, time.Since(t0).Round(time.Millisecond))
		if inst.ID() != id || !pooledDir(filepath.Base(inst.dir)) {
			t.Fatalf("launch %s: instance %s in %s, want a pooled VM under the sandbox's id", id, inst.ID(), inst.dir)
		}
		if st, err := readState(filepath.Join(inst.dir, stateFile)); err != nil || st.ID != id || st.AllowInternet != (k == 1) {
			t.Fatalf("state of %s: %+v %v", id, st, err)
		}
		fpid, running, v := counterState(t, inst)
		if fpid != pid || !running || v < before {
			t.Errorf("%s: counter pid %s running=%v at %d, want pid %s running from ≥ %d", id, fpid, running, v, pid, before)
		}
		// The orchestrator's /init: a token, an environment and a clock of this sandbox.
		tokens[id] = "tok-" + id
		clock := time.Now().Add(time.Duration(k) * time.Hour)
		initEnvd(t, inst, "", tokens[id], map[string]string{"E2B_SANDBOX_ID": id}, clock)
		out, err := shToken(inst, tokens[id], `echo $E2B_SANDBOX_ID; date +%s`)
		if err != nil {
			t.Fatal(err)
		}
		f := strings.Fields(out)
		secs, _ := strconv.ParseInt(f[len(f)-1], 10, 64)
		if len(f) != 2 || f[0] != id || secs < clock.Unix()-5 || secs > clock.Unix()+60 {
			t.Errorf("%s: env and clock %q, want %s and about %d", id, out, id, clock.Unix())
		}
	}
	// Each hand-out holds its own token only.
	for id, other := range map[string]string{"sbx-p1": "sbx-p2", "sbx-p2": "sbx-p1"} {
		b.mu.Lock()
		inst := b.instances[id]
		b.mu.Unlock()
		if _, err := shToken(inst, tokens[other], "true"); err == nil {
			t.Errorf("%s accepted the token of %s", id, other)
		}
	}
	// The pool refills, then the snapshot goes and so does every VM it held.
	poolReady(t, b, cid, 2)
	if err := b.DiscardSnapshot(ctx, c); err != nil {
		t.Fatal(err)
	}
	if left := pooledDirs(b); len(left) != 2 {
		t.Errorf("after the snapshot was discarded: pooled directories %v, want the 2 handed out", left)
	}
	b.vmpool.mu.Lock()
	n := len(b.vmpool.snaps)
	b.vmpool.mu.Unlock()
	if n != 0 {
		t.Errorf("pool still has %d snapshots", n)
	}
}

// TestSnapshotPoolNodeKill: the node dies (nothing stopped) with a snapshot's pool full
// and one pooled VM handed out. The next node adopts the handed-out VM as its sandbox
// (same QEMU, counter running on) and removes the pooled VMs no sandbox had: QEMU,
// disk, slot and directory.
func TestSnapshotPoolNodeKill(t *testing.T) {
	socket := startTestDataPlane(t)
	var cfg Config
	b1 := newTestBackend(t, func(c *Config) {
		c.SnapshotPool = 2
		c.DataPlane = dataplane.NewClient(socket)
		cfg = *c
	})
	ctx := context.Background()
	src := launch(t, b1, "sbx-ksrc", sandbox.Resources{CPUCount: 1, MemoryMB: testMemMB, DiskSizeMB: templateMB})
	mustSh(t, src, counterScript)
	c, err := src.Snapshot(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if err := src.Stop(ctx); err != nil {
		t.Fatal(err)
	}
	cid := c.(*capture).ID
	if _, err := b1.Launch(ctx, sandbox.LaunchPlan{Kind: sandbox.LaunchFromSnapshot, SandboxID: "sbx-k0", Snapshot: c}); err != nil {
		t.Fatal(err)
	}
	poolReady(t, b1, cid, 2)
	got, err := b1.Launch(ctx, sandbox.LaunchPlan{Kind: sandbox.LaunchFromSnapshot, SandboxID: "sbx-k1", Snapshot: c})
	if err != nil {
		t.Fatal(err)
	}
	handed := got.(*Instance)
	waitEnvd(t, handed)
	_, _, v0 := counterState(t, handed)
	handedPID := handed.PID()
	poolReady(t, b1, cid, 2) // refilled: 2 pooled VMs nobody has
	b1.vmpool.mu.Lock()
	var pooledPIDs []int
	for _, inst := range b1.vmpool.snaps[cid].ready {
		pooledPIDs = append(pooledPIDs, inst.PID())
	}
	b1.vmpool.mu.Unlock()

	// The crash: the filler ends with the process and so do its monitor connections
	// (QEMU takes one monitor client at a time); everything else stays as it is.
	b1.vmpool.halt()
	b1.vmpool.mu.Lock()
	var all []*Instance
	for _, sp := range b1.vmpool.snaps {
		all = append(all, sp.ready...)
	}
	b1.vmpool.snaps = map[string]*snapPool{}
	b1.vmpool.mu.Unlock()
	b1.mu.Lock()
	for _, inst := range b1.instances {
		all = append(all, inst)
	}
	b1.instances = map[string]*Instance{}
	b1.mu.Unlock()
	for _, inst := range all {
		inst.proc.m.QMP().Close()
	}

	b2, err := New(ctx, cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		b2.vmpool.close()
		for _, id := range []string{"sbx-k0", "sbx-k1"} {
			b2.mu.Lock()
			inst := b2.instances[id]
			b2.mu.Unlock()
			if inst != nil {
				stopRetry(t, inst)
			}
		}
		if err := b2.pool.Teardown(ctx); err != nil {
			t.Errorf("network teardown: %v", err)
		}
		assertClean(t, b2)
	})
	got2, err := b2.Reconcile(ctx, []string{"sbx-k0", "sbx-k1"})
	if err != nil {
		t.Fatal(err)
	}
	if len(got2) != 2 || got2["sbx-k1"] == nil {
		t.Fatalf("adopted %v, want sbx-k0 and sbx-k1", got2)
	}
	adopted := got2["sbx-k1"].(*Instance)
	if adopted.PID() != handedPID {
		t.Errorf("sbx-k1 adopted with QEMU %d, was %d", adopted.PID(), handedPID)
	}
	if _, running, v := counterState(t, adopted); !running || v <= v0 {
		t.Errorf("sbx-k1 after the restart: counter running=%v at %d (was %d)", running, v, v0)
	}
	if left := pooledDirs(b2); len(left) != 1 {
		t.Errorf("pooled directories after the restart: %v, want sbx-k1's only", left)
	}
	for _, p := range pooledPIDs {
		if alive(p) {
			t.Errorf("pooled QEMU %d survived the restart", p)
		}
	}
	if err := b2.DiscardSnapshot(ctx, c); err != nil {
		t.Fatal(err)
	}
}
