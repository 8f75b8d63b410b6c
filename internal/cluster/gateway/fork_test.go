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
// each bound to its node; children no node has room for fail on their own. The snapshot,
// named after the source, is deleted on the source's node once the children exist; a
// failed delete fails no child.
func TestForkFansOut(t *testing.T) {
	for _, tc := range []struct {
		name         string
		body         string
		deleteStatus int
		code         int
		onA, onB     int
		failed       int
		fansOut      bool
	}{
		{"fits on the source's node", `{"count":2}`, 0, http.StatusOK, 0, 0, 0, false}, // the recorder's fork answer
		{"fans out", `{"count":3,"timeout":30}`, 0, http.StatusCreated, 2, 1, 0, true},
		{"more than the cluster holds", `{"count":6}`, 0, http.StatusCreated, 2, 2, 2, true},
		{"the snapshot's delete fails", `{"count":3}`, http.StatusInternalServerError, http.StatusCreated, 2, 1, 0, true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			f := newFixture(t, "a", "b")
			f.nodes["a"].deleteStatus = tc.deleteStatus
			f.beatWithSlots(t, "a", 3, "src")
			f.beatWithSlots(t, "b", 2)
			code, kids, _ := f.fork(t, "src", tc.body)
			if code != tc.code {
				t.Fatalf("fork = %d %v", code, kids)
			}
			a, b := f.nodes["a"], f.nodes["b"]
			a.mu.Lock()
			snaps, deleted := a.snapshots, a.deleted
			a.mu.Unlock()
			b.mu.Lock()
			bSnaps, bDeleted := b.snapshots, b.deleted
			b.mu.Unlock()
			if len(bSnaps)+len(bDeleted) > 0 {
				t.Fatalf("node b took snapshots %v, deleted %v", bSnaps, bDeleted)
			}
			if !tc.fansOut {
				if len(snaps)+len(deleted) > 0 {
					t.Fatalf("a fork that fits took snapshots %v, deleted %v", snaps, deleted)
				}
				return
			}
			if len(snaps) != 1 || !strings.HasPrefix(snaps[0], forkSnapshotPrefix+"src-") {
				t.Fatalf("fan-out snapshots on the source's node %v, want one named %ssrc-...", snaps, forkSnapshotPrefix)
			}
			if len(deleted) != 1 || !strings.HasPrefix(deleted[0], "a-snap") {
				t.Fatalf("deleted on the source's node %v, want its snapshot", deleted)
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
