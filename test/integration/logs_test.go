package integration

import (
	"context"
	"encoding/json"
	"net/http"
	"os/exec"
	"strings"
	"testing"
	"time"

	"github.com/aenv-dev/aenv/internal/bench"
)

// startScript is the template's start command: a server that logs a line at start and
// one each time /tmp/go appears, so output can be asked for after a restart.
const startScript = `echo before-restart; while true; do if [ -e /tmp/go ]; then rm -f /tmp/go; echo after-restart; fi; sleep 0.1; done`

// TestSandboxLogsAfterRestart restarts a node gracefully while a sandbox on a directory
// template (which survives the restart) runs its template's start command, left running
// (sandbox.shutdown_action=keep) or paused in place (pause) and resumed afterwards, and
// checks that the new node captures the start command's output again, and that
// `aenv logs` prints it.
func TestSandboxLogsAfterRestart(t *testing.T) {
	for _, tt := range []struct{ action, state string }{{"keep", "running"}, {"pause", "paused"}} {
		t.Run(tt.action, func(t *testing.T) {
			n := newNode(t, "AENV_SANDBOX_SHUTDOWN_ACTION="+tt.action, "AENV_TEMPLATES_LAYERED_BASE=false")
			n.start()
			ctx, cancel := context.WithTimeout(context.Background(), 4*time.Minute)
			defer cancel()
			c := n.client()

			tmpl := buildStartCmdTemplate(ctx, t, n, "lgweb-"+randHex(3), startScript)
			sb, err := c.Create(ctx, bench.CreateRequest{TemplateID: tmpl, Timeout: 600, Secure: true})
			if err != nil {
				t.Fatalf("create: %v", err)
			}
			n.observe()
			waitLog(ctx, t, n, sb.ID, "before-restart")

			n.stop()
			n.start()
			if st := states(ctx, t, c)[sb.ID]; st != tt.state {
				t.Fatalf("after restart the sandbox is %q, want %q", st, tt.state)
			}
			if tt.state == "paused" {
				if _, err := c.Connect(ctx, sb.ID, 600); err != nil {
					t.Fatalf("resume after restart: %v", err)
				}
			}
			waitLog(ctx, t, n, sb.ID, "start command output re-attached")
			run(ctx, t, c, sb, "touch /tmp/go")
			waitLog(ctx, t, n, sb.ID, "after-restart")

			// The CLI prints the same logs, as JSON lines when piped.
			cmd := exec.CommandContext(ctx, n.bins.aenv, "logs", sb.ID, "--level", "info")
			cmd.Env = append(cmd.Environ(), "AENV_URL="+n.url(), "AENV_API_KEY="+n.key)
			out, err := cmd.CombinedOutput()
			if err != nil {
				t.Fatalf("aenv logs: %v: %s", err, out)
			}
			var msgs []string
			for _, line := range strings.Split(strings.TrimSpace(string(out)), "\n") {
				var e struct{ Message string }
				if err := json.Unmarshal([]byte(line), &e); err != nil {
					t.Fatalf("aenv logs line %q: %v", line, err)
				}
				msgs = append(msgs, e.Message)
			}
			joined := strings.Join(msgs, "\n")
			if strings.Count(joined, "before-restart") != 1 || !strings.Contains(joined, "after-restart") {
				t.Fatalf("aenv logs printed:\n%s", joined)
			}
			killAll(ctx, t, c)
			n.stop()
			requireNoLeftovers(t, n, nil)
		})
	}
}

// buildStartCmdTemplate builds a template from base with startCmd through the build API
// and returns its id once ready.
func buildStartCmdTemplate(ctx context.Context, t *testing.T, n *node, name, startCmd string) string {
	t.Helper()
	var req struct{ TemplateID, BuildID string }
	apiJSON(ctx, t, n, http.MethodPost, "/v3/templates", map[string]any{"name": name}, http.StatusAccepted, &req)
	apiJSON(ctx, t, n, http.MethodPost, "/v2/templates/"+req.TemplateID+"/builds/"+req.BuildID,
		map[string]any{"fromTemplate": "base-minimal", "startCmd": startCmd, "readyCmd": "true"}, http.StatusAccepted, nil)
	for {
		var st struct {
			Status string
			Logs   []string
		}
		apiJSON(ctx, t, n, http.MethodGet, "/templates/"+req.TemplateID+"/builds/"+req.BuildID+"/status", nil, http.StatusOK, &st)
		switch st.Status {
		case "ready":
			return req.TemplateID
		case "error":
			t.Fatalf("template build failed:\n%s", strings.Join(st.Logs, "\n"))
		}
		select {
		case <-ctx.Done():
			t.Fatalf("template build not ready: %v", ctx.Err())
		case <-time.After(200 * time.Millisecond):
		}
	}
}

// waitLog waits (up to a minute) until the sandbox's logs hold an entry whose message
// contains s.
func waitLog(ctx context.Context, t *testing.T, n *node, id, s string) {
	t.Helper()
	ctx, cancel := context.WithTimeout(ctx, time.Minute)
	defer cancel()
	for {
		var got struct{ Logs []struct{ Message string } }
		apiJSON(ctx, t, n, http.MethodGet, "/v2/sandboxes/"+id+"/logs?search="+strings.ReplaceAll(s, " ", "%20"), nil, http.StatusOK, &got)
		if len(got.Logs) > 0 {
			return
		}
		select {
		case <-ctx.Done():
			var all struct{ Logs []struct{ Message string } }
			apiJSON(context.Background(), t, n, http.MethodGet, "/v2/sandboxes/"+id+"/logs", nil, http.StatusOK, &all)
			t.Fatalf("no log entry with %q in sandbox %s: %+v", s, id, all.Logs)
		case <-time.After(100 * time.Millisecond):
		}
	}
}

// apiJSON sends one request to the node's API with in (unless nil) as its JSON body and
// decodes the answer into out; any other status than want fails the test.
func apiJSON(ctx context.Context, t *testing.T, n *node, method, path string, in any, want int, out any) {
	t.Helper()
	var body []byte
	if in != nil {
		var err error
		if body, err = json.Marshal(in); err != nil {
			t.Fatal(err)
		}
	}
	raw, err := n.api(ctx, method, path, string(body), want)
	if err != nil {
		t.Fatal(err)
	}
	if out != nil {
		if err := json.Unmarshal(raw, out); err != nil {
			t.Fatalf("%s %s: %v: %s", method, path, err, raw)
		}
	}
}
