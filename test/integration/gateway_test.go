package integration

import (
	"context"
	"encoding/json"
	"io"
	"net/http"
	"os/exec"
	"slices"
	"sort"
	"testing"
	"time"

	"github.com/aenv-dev/aenv/internal/bench"
	pb "github.com/aenv-dev/aenv/internal/cluster/scheduler/gen/schedulerv1"
)

// cluster is a scheduler, nodes and a gateway, each a separate process.
type cluster struct {
	sched   pb.SchedulerClient
	nodes   map[string]*node
	gateway string // base URL
	key     string
	bins    binaries
}

func (c *cluster) client(t *testing.T) *bench.Client {
	cl := bench.NewClient(c.gateway, c.key, 8)
	t.Cleanup(cl.Close)
	return cl
}

func (c *cluster) nodeOf(ctx context.Context, t *testing.T, id string) string {
	t.Helper()
	l, err := c.sched.Lookup(ctx, &pb.LookupRequest{SandboxId: id})
	if err != nil {
		t.Fatalf("Lookup(%s): %v", id, err)
	}
	return l.Node.Id
}

// get sends an authenticated GET through the gateway and returns status, body and headers.
func (c *cluster) get(ctx context.Context, t *testing.T, path string) (int, []byte, http.Header) {
	t.Helper()
	req, _ := http.NewRequestWithContext(ctx, http.MethodGet, c.gateway+path, nil)
	req.Header.Set("X-API-Key", c.key)
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	body, _ := io.ReadAll(resp.Body)
	return resp.StatusCode, body, resp.Header
}

// checkPages pages through the gateway's merged list of sandboxes with limit 4 and fails
// the test unless it sees each of want exactly once, and nothing else.
func checkPages(ctx context.Context, t *testing.T, c *cluster, want []string) {
	t.Helper()
	var seen []string
	token := ""
	for pages := 0; ; pages++ {
		q := "/v2/sandboxes?limit=4"
		if token != "" {
			q += "&nextToken=" + token
		}
		code, body, h := c.get(ctx, t, q)
		if code != http.StatusOK {
			t.Fatalf("GET %s: %d %s", q, code, body)
		}
		var items []struct {
			ID string `json:"sandboxID"`
		}
		if err := json.Unmarshal(body, &items); err != nil || len(items) > 4 {
			t.Fatalf("page %s: %v, %d items", body, err, len(items))
		}
		for _, it := range items {
			seen = append(seen, it.ID)
		}
		token = h.Get("X-Next-Token")
		if token == "" {
			break
		}
		if pages > len(want)/4+2 {
			t.Fatal("paging does not end")
		}
	}
	want = slices.Clone(want)
	sort.Strings(seen)
	sort.Strings(want)
	if !slices.Equal(seen, want) {
		t.Fatalf("merged pages listed %v, want %v", seen, want)
	}
}

// checkNodesCLI runs `aenv nodes -o json` against the gateway and fails the test unless it
// lists want nodes, all ready.
func checkNodesCLI(ctx context.Context, t *testing.T, c *cluster, want int) {
	t.Helper()
	out, err := exec.CommandContext(ctx, c.bins.aenv, "nodes", "-o", "json", "--url", c.gateway, "--api-key", c.key).Output()
	var listed []struct {
		NodeID string `json:"nodeID"`
		State  string `json:"state"`
	}
	if err != nil || json.Unmarshal(out, &listed) != nil || len(listed) != want {
		t.Fatalf("aenv nodes: %v\n%s", err, out)
	}
	for _, n := range listed {
		if n.State != "ready" {
			t.Fatalf("aenv nodes lists %s as %q, want ready:\n%s", n.NodeID, n.State, out)
		}
	}
}

// measureOverhead logs the median latency of GET /sandboxes/{id} direct and through the
// gateway (a figure for the notes, not an assertion: this machine is shared).
func measureOverhead(ctx context.Context, t *testing.T, c *cluster, sb bench.Sandbox) {
	n := c.nodes[c.nodeOf(ctx, t, sb.ID)]
	client := &http.Client{}
	median := func(base string) time.Duration {
		var ds []time.Duration
		for range 300 {
			req, _ := http.NewRequestWithContext(ctx, http.MethodGet, base+"/sandboxes/"+sb.ID, nil)
			req.Header.Set("X-API-Key", c.key)
			start := time.Now()
			resp, err := client.Do(req)
			if err != nil {
				t.Fatal(err)
			}
			_, _ = io.Copy(io.Discard, resp.Body)
			resp.Body.Close()
			if resp.StatusCode != http.StatusOK {
				t.Fatalf("GET via %s: %d", base, resp.StatusCode)
			}
			ds = append(ds, time.Since(start))
		}
		slices.Sort(ds)
		return ds[len(ds)/2]
	}
	direct, via := median(n.url()), median(c.gateway)
	t.Logf("GET /sandboxes/{id} p50: direct %v, through the gateway %v (overhead %v)", direct, via, via-direct)
}
