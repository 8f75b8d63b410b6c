package gateway

import (
	"encoding/json"
	"io"
	"net/http"
	"strings"
	"testing"

	pb "github.com/aenv-dev/aenv/internal/cluster/scheduler/gen/schedulerv1"
)

// beatWithSlots heartbeats node id with room for slots sandboxes, running sandboxes.
func (f *fixture) beatWithSlots(t *testing.T, id string, slots int32, sandboxes ...string) {
	t.Helper()
	req := &pb.HeartbeatRequest{Node: &pb.NodeInfo{Id: id, Endpoint: f.nodes[id].srv.URL, Backend: "oci",
		Capacity: &pb.Resources{Sandboxes: slots}}, Allocated: &pb.Resources{Sandboxes: int32(len(sandboxes))}}
	for _, s := range sandboxes {
		req.Sandboxes = append(req.Sandboxes, &pb.SandboxReport{Id: s, State: "running"})
	}
	if err := f.state.Heartbeat(req); err != nil {
		t.Fatal(err)
	}
}

func (f *fixture) fork(t *testing.T, id, body string) (int, []forkChild, http.Header) {
	t.Helper()
	req, _ := http.NewRequest(http.MethodPost, f.gw.URL+"/sandboxes/"+id+"/fork", strings.NewReader(body))
	req.Header.Set("X-API-Key", "k1")
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	raw, _ := io.ReadAll(resp.Body)
	var out []forkChild
	_ = json.Unmarshal(raw, &out)
	return resp.StatusCode, out, resp.Header
}

// A fork that fits on the source's node is forwarded there; one that does not is made
// from a snapshot on the source's node: the children that fit there, the rest elsewhere,
// each bound to its node; children no node has room for fail on their own.
func TestForkFansOut(t *testing.T) {
	for _, tc := range []struct {
		name       string
		body       string
		code       int
		onA, onB   int
		failed     int
		snapshotOn string
	}{
		{"fits on the source's node", `{"count":2}`, http.StatusOK, 0, 0, 0, ""}, // the recorder's fork answer
		{"fans out", `{"count":3,"timeout":30}`, http.StatusCreated, 2, 1, 0, "a"},
		{"more than the cluster holds", `{"count":6}`, http.StatusCreated, 2, 2, 2, "a"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			f := newFixture(t, "a", "b")
			f.beatWithSlots(t, "a", 3, "src")
			f.beatWithSlots(t, "b", 2)
			code, kids, hdr := f.fork(t, "src", tc.body)
			if code != tc.code {
				t.Fatalf("fork = %d %v", code, kids)
			}
			if tc.snapshotOn == "" {
				if hdr.Get(headerForkSnapshot) != "" {
					t.Fatalf("a fork that fits took a snapshot %s", hdr.Get(headerForkSnapshot))
				}
				return
			}
			if snap := hdr.Get(headerForkSnapshot); !strings.HasPrefix(snap, tc.snapshotOn+"-snap") {
				t.Fatalf("fan-out snapshot %q, want one taken on %s", snap, tc.snapshotOn)
			}
			on := map[string]int{}
			failed := 0
			for _, k := range kids {
				if k.Error != nil {
					failed++
					continue
				}
				var sb struct {
					ID string `json:"sandboxID"`
				}
				if err := json.Unmarshal(k.Sandbox, &sb); err != nil {
					t.Fatal(err)
				}
				node, _, _ := strings.Cut(sb.ID, "-")
				on[node]++
				l, err := f.state.Lookup(sb.ID)
				if err != nil || l.Node.Id != node {
					t.Fatalf("child %s bound to %v, %v; want %s", sb.ID, l, err, node)
				}
			}
			if on["a"] != tc.onA || on["b"] != tc.onB || failed != tc.failed {
				t.Fatalf("children: %v, %d failed; want a %d, b %d, %d failed", on, failed, tc.onA, tc.onB, tc.failed)
			}
		})
	}
}
