package gateway

import (
	"encoding/json"
	"fmt"
	"net/http"
	"strings"
	"time"

	pb "github.com/aenv-dev/aenv/internal/cluster/scheduler/gen/schedulerv1"
)

// NodeStatus is one node of GET /nodes (what `aenv nodes` prints).
type NodeStatus struct {
	NodeID        string    `json:"nodeID"`
	Endpoint      string    `json:"endpoint"`
	State         string    `json:"state"`
	Backend       string    `json:"backend"`
	Version       string    `json:"version"`
	Capacity      Resources `json:"capacity"`
	Allocated     Resources `json:"allocated"`
	Reserved      Resources `json:"reserved"`
	Sandboxes     int32     `json:"sandboxes"`
	LastHeartbeat time.Time `json:"lastHeartbeat"`
}

// Resources is an amount of CPUs, memory and sandbox slots.
type Resources struct {
	CPUCount  int32 `json:"cpuCount"`
	MemoryMB  int64 `json:"memoryMB"`
	Sandboxes int32 `json:"sandboxes"`
}

func resourcesOf(r *pb.Resources) Resources {
	return Resources{CPUCount: r.GetCpuCount(), MemoryMB: r.GetMemoryMb(), Sandboxes: r.GetSandboxes()}
}

// nodes answers GET /nodes from the scheduler's view: every known node, live or not.
func (g *Gateway) nodes(w http.ResponseWriter, r *http.Request) {
	resp, err := g.sched.ListNodes(r.Context(), &pb.ListNodesRequest{})
	if err != nil {
		g.schedulerError(w, "list nodes", err)
		return
	}
	out := make([]NodeStatus, 0, len(resp.Nodes))
	for _, n := range resp.Nodes {
		out = append(out, NodeStatus{
			NodeID:        n.Node.GetId(),
			Endpoint:      n.Node.GetEndpoint(),
			State:         strings.ToLower(strings.TrimPrefix(n.State.String(), "NODE_STATE_")),
			Backend:       n.Node.GetBackend(),
			Version:       n.Node.GetVersion(),
			Capacity:      resourcesOf(n.Node.GetCapacity()),
			Allocated:     resourcesOf(n.Allocated),
			Reserved:      resourcesOf(n.Reserved),
			Sandboxes:     n.Sandboxes,
			LastHeartbeat: time.UnixMilli(n.LastHeartbeatUnixMs).UTC(),
		})
	}
	w.Header().Set("Content-Type", "application/json")
	_ = json.NewEncoder(w).Encode(out)
}

// drain serves POST /nodes/{id}/drain and /nodes/{id}/undrain: the call goes to the node
// (POST /aenv/drain, with the caller's API key), which heartbeats as draining at once (no
// new placements) and pauses its running sandboxes to disk, published for the other
// nodes; their next resume through a gateway runs them on another node.
func (g *Gateway) drain(w http.ResponseWriter, r *http.Request, nodeID string, draining bool) {
	resp, err := g.sched.ListNodes(r.Context(), &pb.ListNodesRequest{})
	if err != nil {
		g.schedulerError(w, "list nodes", err)
		return
	}
	var t *target
	for _, n := range resp.Nodes {
		if n.Node.GetId() != nodeID {
			continue
		}
		if n.State == pb.NodeState_NODE_STATE_STALE {
			writeError(w, http.StatusConflict, "node %s is stale (no heartbeat): it cannot be drained; its disk-paused sandboxes resume elsewhere anyway", nodeID)
			return
		}
		if t, err = targetOf(n.Node); err != nil {
			writeError(w, http.StatusBadGateway, "%v", err)
			return
		}
	}
	if t == nil {
		writeError(w, http.StatusNotFound, "node %q is not in the cluster", nodeID)
		return
	}
	u := *t.base
	u.Path = "/aenv/drain"
	body := fmt.Sprintf(`{"draining":%t}`, draining)
	out, err := http.NewRequestWithContext(r.Context(), http.MethodPost, u.String(), strings.NewReader(body))
	if err != nil {
		writeError(w, http.StatusInternalServerError, "%v", err)
		return
	}
	out.Header.Set("Content-Type", "application/json")
	out.Header.Set("X-API-Key", r.Header.Get("X-API-Key"))
	nresp, err := g.client.Do(out)
	if err != nil {
		writeError(w, http.StatusBadGateway, "node %s (%s) did not answer: %v", nodeID, t.base, err)
		return
	}
	copyResponse(w, nresp)
}

// nodeAction parses /nodes/{id}/drain and /nodes/{id}/undrain.
func nodeAction(p string) (id string, draining, ok bool) {
	rest, found := strings.CutPrefix(p, "/nodes/")
	if !found {
		return "", false, false
	}
	id, action, found := strings.Cut(rest, "/")
	if !found || id == "" || (action != "drain" && action != "undrain") {
		return "", false, false
	}
	return id, action == "drain", true
}
