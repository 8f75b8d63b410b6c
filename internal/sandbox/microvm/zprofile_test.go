package microvm

import (
	"context"
	"fmt"
	"io"
	"net/http"
	"os"
	"testing"
	"time"

	"github.com/aenv-dev/aenv/internal/envdclient"
	"github.com/aenv-dev/aenv/internal/sandbox"
)

func profSteps(t *testing.T, i *Instance, label string) {
	ep := i.Endpoint()
	base := fmt.Sprintf("http://%s:%d", ep.Host, ep.EnvdPort)
	tok := "tok-" + i.id
	run := func(name string, c envdclient.Command, token string) {
		cl := envdclient.New(http.DefaultClient, base, envdclient.WithAccessToken(token), envdclient.WithJSON())
		t0 := time.Now()
		p, err := cl.Start(context.Background(), c)
		if err != nil {
			t.Fatalf("%s: %v", name, err)
		}
		ts := time.Since(t0)
		if _, err := p.Wait(io.Discard, io.Discard); err != nil {
			t.Fatal(err)
		}
		p.Close()
		t.Logf("%s %-28s start %6.1f ms  total %6.1f ms", label, name, ms(ts), ms(time.Since(t0)))
	}
	t0 := time.Now()
	initEnvd(t, i, "", tok, map[string]string{"E2B_SANDBOX_ID": i.id}, time.Now())
	t.Logf("%s /init %6.1f ms", label, ms(time.Since(t0)))
	for k := 0; k < 2; k++ {
		run(fmt.Sprintf("sdk bash -l -c echo#%d", k), envdclient.Command{Cmd: "/bin/bash", Args: []string{"-l", "-c", "echo hi"}}, tok)
	}
	run("user bash -l -c ls", envdclient.Command{Cmd: "/bin/bash", Args: []string{"-l", "-c", "ls /"}, User: "user"}, tok)
}

func ms(d time.Duration) float64 { return float64(d.Microseconds()) / 1000 }

func TestZProfile(t *testing.T) {
	if os.Getenv("AENV_PROFILE") == "" {
		t.Skip()
	}
	b := newTestBackend(t, func(c *Config) { c.Network.PoolSize = 0; c.SnapshotPool = 1 })
	ctx := context.Background()
	src := launch(t, b, "sbx-zsrc", sandbox.Resources{CPUCount: 1, MemoryMB: testMemMB, DiskSizeMB: templateMB})
	c, err := src.Snapshot(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer b.DiscardSnapshot(ctx, c)
	src.Stop(ctx)
	cid := c.(*capture).ID
	for n := 0; n < 3; n++ {
		poolReady(t, b, cid, 1)
		inst, err := b.Launch(ctx, sandbox.LaunchPlan{Kind: sandbox.LaunchFromSnapshot, SandboxID: fmt.Sprintf("sbx-z%d", n), Snapshot: c, AllowInternet: true})
		if err != nil {
			t.Fatal(err)
		}
		waitEnvd(t, inst.(*Instance))
		profSteps(t, inst.(*Instance), fmt.Sprintf("pooled%d", n))
		stopRetry(t, inst)
	}
}
