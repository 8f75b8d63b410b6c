package integration

import (
	"context"
	"encoding/json"
	"fmt"
	"net/http"
	"runtime"
	"strings"
	"syscall"
	"testing"
	"time"
)

// TestAdmissionRefusals drives a real node whose memory capacity (host memory ×
// sandbox.memory_overcommit) holds two sandboxes of 512 MB: requests above what the node
// can ever give and oversized env vars and metadata answer 400 naming the limit, a third
// sandbox answers 503, and none of the refusals leaves a sandbox behind.
func TestAdmissionRefusals(t *testing.T) {
	var si syscall.Sysinfo_t
	if err := syscall.Sysinfo(&si); err != nil {
		t.Fatal(err)
	}
	hostMB := float64(si.Totalram) * float64(si.Unit) / (1 << 20)
	ratio := 1100.5 / hostMB
	n := newNode(t, "AENV_SANDBOX_SHUTDOWN_ACTION=stop", "AENV_SANDBOX_DEFAULT_MEMORY_MB=512",
		fmt.Sprintf("AENV_SANDBOX_MEMORY_OVERCOMMIT=%.9f", ratio))
	n.start()
	ctx, cancel := context.WithTimeout(context.Background(), 4*time.Minute)
	defer cancel()
	c := n.client()

	refuse := func(name, body string, want int, parts ...string) {
		t.Helper()
		before := states(ctx, t, c)
		out, err := n.api(ctx, http.MethodPost, "/v2/sandboxes", body, want)
		if err != nil {
			t.Errorf("%s: %v", name, err)
			return
		}
		var e struct {
			Code    int    `json:"code"`
			Message string `json:"message"`
		}
		if err := json.Unmarshal(out, &e); err != nil || e.Code != want {
			t.Errorf("%s: answer %s is not an E2B error with code %d", name, out, want)
		}
		for _, p := range parts {
			if !strings.Contains(e.Message, p) {
				t.Errorf("%s: message %q does not say %q", name, e.Message, p)
			}
		}
		if after := states(ctx, t, c); fmt.Sprint(after) != fmt.Sprint(before) {
			t.Errorf("%s: the refusal changed the sandboxes: %v, was %v", name, after, before)
		}
	}
	refuse("95 TiB of memory", `{"templateID":"base-minimal","memoryMB":100000000}`, 400,
		"memoryMB 100000000", "limit is 1100 MB", "memory_overcommit")
	refuse("more CPUs than the host", fmt.Sprintf(`{"templateID":"base-minimal","cpuCount":%d}`, runtime.NumCPU()+1), 400,
		fmt.Sprintf("cpuCount %d", runtime.NumCPU()+1), "cpu_overcommit")
	refuse("env var of 200 KB", `{"templateID":"base-minimal","envVars":{"BIG":"`+strings.Repeat("x", 200<<10)+`"}}`, 400,
		"BIG", "65536 bytes per variable")
	refuse("metadata of 70 KB", `{"templateID":"base-minimal","metadata":{"k":"`+strings.Repeat("v", 70<<10)+`"}}`, 400,
		"metadata total")

	a := n.create(ctx, c)
	n.create(ctx, c)
	refuse("a full node", `{"templateID":"base-minimal"}`, 503, "node is out of sandbox capacity", "1024 of its 1100 MB", "asks for 512 MB")
	// Sandboxes that fit still work, and a kill gives the memory back.
	run(ctx, t, c, a, "true")
	if err := c.Kill(ctx, a.ID); err != nil {
		t.Fatal(err)
	}
	b := n.create(ctx, c)
	if got := run(ctx, t, c, b, "echo ok"); got != "ok" {
		t.Fatalf("sandbox after the refusals answered %q", got)
	}
	if out := n.output(); strings.Contains(out, "level=ERROR") {
		t.Errorf("the node logged errors for refused requests:\n%s", out)
	}
}
