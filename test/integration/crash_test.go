package integration

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/aenv-dev/aenv/internal/bench"
)

// TestCrashRecovery kills the node with SIGKILL while it holds three sandboxes (one paused),
// checks that the sandboxes outlived it, restarts it on the same data dir and checks that it
// adopted them (same containers, same tokens, the paused one resumes), that it cleaned up
// the warm containers of the dead process, and that after killing everything through the API
// and stopping the node nothing is left on the host.
//
// The node runs a directory base template (TestLayeredSandboxesSurviveNodeKill covers
// layered roots, whose disks the data plane serves across the crash).
func TestCrashRecovery(t *testing.T) {
	n := newNode(t, "AENV_SANDBOX_SHUTDOWN_ACTION=stop", "AENV_TEMPLATES_LAYERED_BASE=false")
	n.start()
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	c := n.client()

	sbs := make([]bench.Sandbox, 3)
	for i := range sbs {
		sbs[i] = n.create(ctx, c)
		run(ctx, t, c, sbs[i], fmt.Sprintf("echo mark-%d > /tmp/mark", i))
	}
	paused := sbs[2]
	if err := c.Pause(ctx, paused.ID); err != nil {
		t.Fatal(err)
	}
	n.observe()
	oldPid := n.pid()
	before := runtimeList(t, n.dataDir)
	cids := make([]string, len(sbs))
	for i, sb := range sbs {
		if cids[i] = n.seen.cidOf(sb.ID); cids[i] == "" {
			t.Fatalf("no container recorded for sandbox %s", sb.ID)
		}
	}

	n.kill9()

	// The sandboxes outlive the node: containers, rootfs mounts, namespaces, cgroups.
	after := runtimeList(t, n.dataDir)
	mounts := strings.Join(mountsUnder(t, n.dataDir), "\n")
	seen := n.seen.snapshot()
	for i, cid := range cids {
		want := "running"
		if i == 2 {
			want = "paused"
		}
		if got := after[cid]; got.Status != want || got.Pid != before[cid].Pid {
			t.Errorf("after kill -9, container %s of sandbox %s is %+v, want %s with pid %d", cid, sbs[i].ID, got, want, before[cid].Pid)
		}
		if !strings.Contains(mounts, filepath.Join(n.dataDir, "oci", "sandboxes", cid, "rootfs")) {
			t.Errorf("after kill -9, the rootfs of %s is not mounted", sbs[i].ID)
		}
		if _, err := os.Stat("/run/netns/" + seen[cid].netns); err != nil {
			t.Errorf("after kill -9, the netns of %s is gone: %v", sbs[i].ID, err)
		}
		if len(cgroupsOf(n.cgroupParent(), cid)) == 0 {
			t.Errorf("after kill -9, the cgroup of %s is gone", sbs[i].ID)
		}
	}
	if t.Failed() {
		t.FailNow()
	}

	n.start()
	got := states(ctx, t, c)
	want := map[string]string{sbs[0].ID: "running", sbs[1].ID: "running", sbs[2].ID: "paused"}
	if fmt.Sprint(got) != fmt.Sprint(want) {
		// Go on: whatever was adopted or dropped, nothing may leak in the end.
		t.Errorf("after restart the node lists %v, want %v", got, want)
	}
	// Adopted, not recreated: the same init process answers, with the token it was given,
	// and still has the file written before the crash.
	now := runtimeList(t, n.dataDir)
	for i, sb := range sbs[:2] {
		if got[sb.ID] != "running" {
			continue
		}
		if now[cids[i]].Pid != before[cids[i]].Pid {
			t.Errorf("sandbox %s: init pid %d after restart, was %d", sb.ID, now[cids[i]].Pid, before[cids[i]].Pid)
		}
		if out := run(ctx, t, c, sb, "cat /tmp/mark"); out != fmt.Sprintf("mark-%d", i) {
			t.Errorf("sandbox %s: /tmp/mark = %q after restart", sb.ID, out)
		}
	}
	// The warm containers of the crashed process (not yet given to a sandbox) were removed.
	stale := fmt.Sprintf("warm.%d.", oldPid)
	for id := range now {
		if strings.HasPrefix(id, stale) && !slices.Contains(cids, id) {
			t.Errorf("warm container %s of the crashed node survived the restart", id)
		}
	}
	if got[paused.ID] == "paused" {
		resumed, err := c.Connect(ctx, paused.ID, 300)
		switch {
		case err != nil:
			t.Errorf("connect to the paused sandbox: %v", err)
		case resumed.Token != paused.Token && resumed.Token != "":
			t.Errorf("resume changed the envd token")
		default:
			if out := run(ctx, t, c, paused, "cat /tmp/mark"); out != "mark-2" {
				t.Errorf("resumed sandbox: /tmp/mark = %q", out)
			}
			if st := states(ctx, t, c)[paused.ID]; st != "running" {
				t.Errorf("resumed sandbox is %q", st)
			}
		}
	}
	// The restarted node still creates sandboxes next to the adopted ones.
	fresh := n.create(ctx, c)
	run(ctx, t, c, fresh, "true")

	killAll(ctx, t, c)
	n.stop()
	requireNoLeftovers(t, n, nil)
}
