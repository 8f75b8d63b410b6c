package microvm

import (
	"context"
	"encoding/json"
	"fmt"
	"maps"
	"net/http"
	"testing"
	"time"

	"connectrpc.com/connect"

	"github.com/aenv-dev/aenv/internal/envd/gen/process"
	"github.com/aenv-dev/aenv/internal/envdclient"
	"github.com/aenv-dev/aenv/internal/sandbox"
)

// sdkCommand runs script the way the E2B SDKs' commands.run does: `/bin/bash -l -c`
// as the default user over Connect JSON, with the access token. It returns stdout.
func sdkCommand(i *Instance, token, script string) (string, error) {
	ep := i.Endpoint()
	c := envdclient.New(http.DefaultClient, fmt.Sprintf("http://%s:%d", ep.Host, ep.EnvdPort),
		envdclient.WithAccessToken(token), envdclient.WithJSON())
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	p, err := c.Start(ctx, envdclient.Command{Cmd: "/bin/bash", Args: []string{"-l", "-c", script}})
	if err != nil {
		return "", err
	}
	defer p.Close()
	var stdout, stderr bufWriter
	end, err := p.Wait(&stdout, &stderr)
	if err != nil {
		return "", err
	}
	if end.GetExitCode() != 0 {
		return "", fmt.Errorf("%q exited %d: %s", script, end.GetExitCode(), stderr)
	}
	return string(stdout), nil
}

type bufWriter []byte

func (b *bufWriter) Write(p []byte) (int, error) { *b = append(*b, p...); return len(p), nil }

// envs is envd's GET /envs with token.
func envs(t testing.TB, i *Instance, token string) map[string]string {
	t.Helper()
	ep := i.Endpoint()
	req, _ := http.NewRequest(http.MethodGet, fmt.Sprintf("http://%s:%d/envs", ep.Host, ep.EnvdPort), nil)
	req.Header.Set("X-Access-Token", token)
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	got := map[string]string{}
	if resp.StatusCode != http.StatusOK {
		t.Fatalf("envs of %s: %s", i.id, resp.Status)
	}
	if err := json.NewDecoder(resp.Body).Decode(&got); err != nil {
		t.Fatal(err)
	}
	return got
}

// TestSnapshotPoolWarmupLeavesNothing: a pooled VM of a secure sandbox's snapshot is
// warmed through a first command's paths (with the token the snapshot's envd holds),
// and the sandbox it becomes carries nothing of it: the snapshot's token until the
// orchestrator's /init replaces it, then exactly the environment of the snapshot plus
// that /init's, no process, and the same files in /tmp and the user's home as the
// snapshotted sandbox had.
func TestSnapshotPoolWarmupLeavesNothing(t *testing.T) {
	b := newTestBackend(t, func(c *Config) { c.SnapshotPool = 1 })
	ctx := context.Background()
	got, err := b.Launch(ctx, sandbox.LaunchPlan{Kind: sandbox.LaunchFresh, SandboxID: "sbx-wsrc", RootFS: fix.template,
		Resources: sandbox.Resources{CPUCount: 1, MemoryMB: testMemMB, DiskSizeMB: templateMB}, EnvdAccessToken: "tok-src"})
	if err != nil {
		t.Fatal(err)
	}
	src := got.(*Instance)
	waitEnvd(t, src)
	srcEnv := map[string]string{"E2B_SANDBOX_ID": "sbx-wsrc", "SRC_VAR": "kept"}
	initEnvd(t, src, "", "tok-src", srcEnv, time.Now())
	const listing = `ls -A /tmp /home/user; echo "$HOME"`
	before, err := sdkCommand(src, "tok-src", listing)
	if err != nil {
		t.Fatal(err)
	}
	c, err := src.Snapshot(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer b.DiscardSnapshot(ctx, c)
	if err := src.Stop(ctx); err != nil {
		t.Fatal(err)
	}
	poolReady(t, b, c.(*capture).ID, 1)
	if n := b.vmpool.warmed.Load(); n < 1 {
		t.Fatalf("no pooled VM went through the whole warm-up (%d)", n)
	}
	got, err = b.Launch(ctx, sandbox.LaunchPlan{Kind: sandbox.LaunchFromSnapshot, SandboxID: "sbx-wnew", Snapshot: c,
		EnvdAccessToken: "tok-new", HeldEnvdToken: "tok-src"})
	if err != nil {
		t.Fatal(err)
	}
	inst := got.(*Instance)
	if !pooledDir(inst.dir[len(b.cfg.sandboxesDir())+1:]) {
		t.Fatalf("%s did not come from the pool (%s)", inst.id, inst.dir)
	}
	waitEnvd(t, inst)
	// The orchestrator's /init needs the snapshot's token: the warm-up kept it.
	initEnvd(t, inst, "tok-src", "tok-new", map[string]string{"E2B_SANDBOX_ID": "sbx-wnew"}, time.Now())
	want := maps.Clone(srcEnv)
	want["E2B_SANDBOX_ID"], want["E2B_SANDBOX"] = "sbx-wnew", "true"
	if env := envs(t, inst, "tok-new"); !maps.Equal(env, want) {
		t.Errorf("environment after hand-out %v, want %v", env, want)
	}
	ep := inst.Endpoint()
	pc := envdclient.New(http.DefaultClient, fmt.Sprintf("http://%s:%d", ep.Host, ep.EnvdPort), envdclient.WithAccessToken("tok-new"))
	list, err := pc.Proc.List(ctx, connect.NewRequest(&process.ListRequest{}))
	if err != nil {
		t.Fatal(err)
	}
	if ps := list.Msg.GetProcesses(); len(ps) != 0 {
		t.Errorf("processes after hand-out: %v, want none", ps)
	}
	after, err := sdkCommand(inst, "tok-new", listing)
	if err != nil {
		t.Fatal(err)
	}
	if after != before {
		t.Errorf("/tmp and home after hand-out:\n%s\nin the snapshotted sandbox:\n%s", after, before)
	}
	if _, err := sdkCommand(inst, "tok-src", "true"); err == nil {
		t.Error("the snapshot's token still works after the sandbox's /init")
	}
	stopRetry(t, inst)
}
