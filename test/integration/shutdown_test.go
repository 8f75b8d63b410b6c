package integration

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/aenv-dev/aenv/internal/bench"
)

// TestGracefulShutdown stops a node holding two sandboxes with SIGTERM under each
// sandbox.shutdown_action and checks that exactly what the action promises is left: nothing
// for stop; the sandboxes' containers (paused, or running for keep) with their mounts,
// namespaces and cgroups, and no warm containers, for pause and keep. The survivors must come
// back after a restart; then everything is killed and nothing may be left. On a layered base
// template, pause means pause to disk: nothing is left on the host but the sandboxes come back.
func TestGracefulShutdown(t *testing.T) {
	tests := []struct {
		action string
		// left is the runtime status of each sandbox's container after the shutdown, "" for none.
		left string
		// state is what the restarted node reports for them, "" when they are gone.
		state string
		// layered runs the sandboxes on a layered (block) base template.
		layered bool
	}{
		{action: "stop"},
		{action: "pause", left: "paused", state: "paused"},
		{action: "keep", left: "running", state: "running"},
		{action: "pause", state: "paused", layered: true},
	}
	for _, tt := range tests {
		name := tt.action
		if tt.layered {
			name += "-layered"
		}
		t.Run(name, func(t *testing.T) {
			n := newNode(t, "AENV_SANDBOX_SHUTDOWN_ACTION="+tt.action, fmt.Sprintf("AENV_TEMPLATES_LAYERED_BASE=%v", tt.layered))
			n.start()
			ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
			defer cancel()
			c := n.client()
			sbs := []bench.Sandbox{n.create(ctx, c), n.create(ctx, c)}
			for _, sb := range sbs {
				run(ctx, t, c, sb, "echo kept > /tmp/mark")
			}
			n.observe()
			n.stop()

			keep := map[string]bool{}
			if tt.left != "" {
				containers := runtimeList(t, n.dataDir)
				for _, sb := range sbs {
					cid := n.seen.cidOf(sb.ID)
					if got := containers[cid].Status; got != tt.left {
						t.Errorf("sandbox %s: container %q is %q after shutdown, want %q", sb.ID, cid, got, tt.left)
					}
					keep[cid] = true
				}
			}
			requireNoLeftovers(t, n, keep)
			if tt.state == "" {
				return
			}

			// The survivors are the node's again after a restart.
			n.start()
			got := states(ctx, t, c)
			for _, sb := range sbs {
				if got[sb.ID] != tt.state {
					t.Errorf("after restart sandbox %s is %q, want %q (all: %v)", sb.ID, got[sb.ID], tt.state, got)
				}
			}
			if _, err := c.Connect(ctx, sbs[0].ID, 60); err != nil {
				// Go on: whatever the restart kept, nothing may leak in the end.
				t.Errorf("connect after restart: %v", err)
			} else if out := run(ctx, t, c, sbs[0], "cat /tmp/mark"); out != "kept" {
				t.Errorf("after restart /tmp/mark = %q, want kept", out)
			}
			killAll(ctx, t, c)
			n.stop()
			requireNoLeftovers(t, n, nil)
		})
	}
}
