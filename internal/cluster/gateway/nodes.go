package gateway

import (
	"encoding/json"
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
