package integration

import (
	"context"
	"fmt"
	"math/rand/v2"
	"net/http"
	"os"
	"slices"
	"strconv"
	"sync"
	"testing"
	"time"

	"github.com/aenv-dev/aenv/internal/bench"
	"github.com/aenv-dev/aenv/internal/orchestrator"
)

// TestKillStorm runs 20 sandboxes on the layered base (files, background processes) and
// kills the node with SIGKILL again and again while it works: once at every debug crash
// point of a snapshot, a fork and a pause to disk, then at random moments of a burst of
// creates, forks, snapshots and pauses (AENV_IT_KILLS kills in all, default 30), then
// upgrades it (another build, same data plane). After
// every restart each of the 20 runs on with the same init and background process, its
// files intact and its root writable, and no thread is left in state D. In the end
// everything is killed through the API and nothing is left on the host.
func TestKillStorm(t *testing.T) {
	const count = 20
	kills := 30
	if s := os.Getenv("AENV_IT_KILLS"); s != "" {
		var err error
		if kills, err = strconv.Atoi(s); err != nil {
			t.Fatalf("AENV_IT_KILLS=%q: %v", s, err)
		}
	}
	n := newNode(t, "AENV_SANDBOX_SHUTDOWN_ACTION=stop", "AENV_SNAPSHOT_SYNC_INTERVAL=1s")
	n.start()
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Minute)
	defer cancel()
	c := n.client()
	ss := makeSurvivors(ctx, t, n, c, count)
	if len(loopDevices(n.dataDir)) == 0 {
		t.Skip("the base template is not layered on this host: no sandbox runs on a block root")
	}
	keep := map[string]bool{}
	for _, s := range ss {
		keep[s.sb.ID] = true
	}
	var restarts []time.Duration
	check := func() {
		checkSurvivors(ctx, t, n, c, ss)
		requireNoBlocked(t)
		if t.Failed() {
			t.FailNow()
		}
		// What the interrupted work left running goes, so the node stays at its 20.
		for id := range states(ctx, t, c) {
			if !keep[id] {
				_ = c.Kill(ctx, id)
			}
		}
	}

	done := 0
	for _, p := range []struct {
		point string
		act   func(ctx context.Context, n *node, id string) error
	}{
		{orchestrator.CrashSnapshotCaptured, snapshotOf},
		{orchestrator.CrashSnapshotRegistered, snapshotOf},
		{orchestrator.CrashSnapshotPublishing, snapshotOf},
		{orchestrator.CrashForkCaptured, forkOf(2)},
		{orchestrator.CrashForkLaunched, forkOf(2)},
		{orchestrator.CrashPauseCaptured, pauseToDisk},
		{orchestrator.CrashPausePersisted, pauseToDisk},
	} {
		if done >= kills {
			break
		}
		// Arming the crash point takes a restart: kill -9 (shutdown_action=stop would
		// kill the 20 on a graceful stop), so this is one of the kills too.
		n.observe()
		n.kill9()
		done++
		n.restartWith(orchestrator.CrashPointEnv + "=" + p.point)
		src := n.create(ctx, c)
		if err := p.act(ctx, n, src.ID); err == nil {
			t.Fatalf("the operation answered although the node was to die at %s", p.point)
		}
		if !n.waitExit(30 * time.Second) {
			t.Fatalf("the node did not die at crash point %s", p.point)
		}
		start := time.Now()
		n.restartWith()
		restarts = append(restarts, time.Since(start))
		check()
		done++
	}

	rng := rand.New(rand.NewPCG(uint64(time.Now().UnixNano()), 1))
	for ; done < kills; done++ {
		stop := make(chan struct{})
		var wg sync.WaitGroup
		for w := range 4 {
			wg.Add(1)
			go func() {
				defer wg.Done()
				burst(ctx, n, c, w, stop)
			}()
		}
		time.Sleep(time.Duration(100+rng.IntN(1400)) * time.Millisecond)
		n.observe()
		n.kill9()
		close(stop)
		// Started before the workers are waited for: a request the dead node accepted
		// ends when the next node has cleared whatever the dead one left holding its port.
		start := time.Now()
		n.restartWith()
		restarts = append(restarts, time.Since(start))
		wg.Wait()
		check()
	}
	slices.Sort(restarts)
	if len(restarts) > 0 {
		t.Logf("%d kills with %d sandboxes running; restart → API answering: median %v, max %v",
			len(restarts), count, restarts[len(restarts)/2].Round(time.Millisecond), restarts[len(restarts)-1].Round(time.Millisecond))
	}

	// An upgrade with the 20 running: another build of aenv replaces the binary and
	// the node restarts on it; the data plane of the old build serves on and the new
	// node adopts every sandbox.
	dpPid := n.dataPlanePid(t)
	n.bins.aenv = buildVersioned(t, "it-storm-upgrade")
	n.observe()
	n.kill9()
	n.restartWith()
	check()
	if pid := n.dataPlanePid(t); pid != dpPid {
		t.Errorf("the data plane is pid %d after the upgrade, was %d", pid, dpPid)
	}

	// Every snapshot the storm registered is whole: it launches, and its publication
	// completes with every blob it names.
	snaps := n.snapshots(ctx, t)
	for i, id := range snaps {
		if i < 3 {
			sb, err := c.Create(ctx, bench.CreateRequest{TemplateID: id, Timeout: 300, Secure: true})
			if err != nil {
				t.Errorf("create from snapshot %s taken during the storm: %v", id, err)
			} else if _, err := c.Run(ctx, sb, "cat /home/user/b"); err != nil {
				t.Errorf("sandbox from snapshot %s: %v", id, err)
			}
		}
		waitComplete(ctx, t, n.repo(t), id)
	}
	requireRepositoryConsistent(ctx, t, n)
	for _, id := range snaps {
		if _, err := n.api(ctx, http.MethodDelete, "/templates/"+id, "", http.StatusNoContent); err != nil {
			t.Fatal(err)
		}
	}
	killAll(ctx, t, c)
	n.stop()
	if pid := n.dataPlanePid(t); pid != 0 {
		t.Errorf("the idle data plane (pid %d) still runs after the node stopped", pid)
		n.stopDataPlane(t)
	}
	requireNoLeftovers(t, n, nil)
	requireNoStateLeftovers(t, n)
}

// burst is one worker of the work a kill interrupts: create, then one of fork, snapshot,
// pause to disk and resume, or kill, until stop. Errors are expected (the node dies).
func burst(ctx context.Context, n *node, c *bench.Client, w int, stop <-chan struct{}) {
	// Bounded: a request to a node that dies may never be answered.
	ctx, cancel := context.WithTimeout(ctx, 2*time.Minute)
	defer cancel()
	for i := 0; ; i++ {
		select {
		case <-stop:
			return
		default:
		}
		sb, err := c.Create(ctx, bench.CreateRequest{TemplateID: "base", Timeout: 600, Secure: true})
		if err != nil {
			return
		}
		_, _ = c.Run(ctx, sb, fmt.Sprintf("echo burst-%d-%d > /home/user/b", w, i))
		switch (w + i) % 4 {
		case 0:
			_ = forkOf(2)(ctx, n, sb.ID)
		case 1:
			_ = snapshotOf(ctx, n, sb.ID)
		case 2:
			if pauseToDisk(ctx, n, sb.ID) == nil {
				_, _ = c.Connect(ctx, sb.ID, 600)
			}
		default:
			_ = c.Kill(ctx, sb.ID)
		}
	}
}
