package gateway

import (
	"context"
	"fmt"
	"net/http"
	"net/url"
	"sort"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	pb "github.com/aenv-dev/aenv/internal/cluster/scheduler/gen/schedulerv1"
	"github.com/aenv-dev/aenv/internal/relay"
)

// target is the node a request is forwarded to.
type target struct {
	node string
	base *url.URL
	// sandbox is the sandbox the request was routed for ("" for node-wide calls).
	sandbox string
}

type targetKey struct{}

// schedulerTimeout bounds one scheduler call made while serving a request.
const schedulerTimeout = 5 * time.Second

func targetOf(n *pb.NodeInfo) (*target, error) {
	u, err := url.Parse(n.GetEndpoint())
	if err != nil || u.Host == "" {
		return nil, fmt.Errorf("node %s advertises an unusable endpoint %q", n.GetId(), n.GetEndpoint())
	}
	return &target{node: n.Id, base: u}, nil
}

// forward proxies r to t, streaming both ways.
func (g *Gateway) forward(w http.ResponseWriter, r *http.Request, t *target) {
	relay.Serve(g.proxy, w, r.WithContext(context.WithValue(r.Context(), targetKey{}, t)))
}

// toSandbox forwards r to the node holding sandbox id, or says clearly why it cannot:
// unknown sandbox (404), its node silent (503: the sandbox is lost unless the node returns).
func (g *Gateway) toSandbox(w http.ResponseWriter, r *http.Request, id string) {
	if isResume(r, id) {
		g.resume(w, r, id)
		return
	}
	now := time.Now()
	if t := g.routes.get(id, now); t != nil {
		g.forward(w, r, t)
		return
	}
	l, err := g.lookup(r.Context(), id)
	switch status.Code(err) {
	case codes.OK:
	case codes.NotFound:
		writeError(w, http.StatusNotFound, "sandbox %q not found", id)
		return
	default:
		g.schedulerError(w, "look up sandbox "+id, err)
		return
	}
	if l.State == pb.NodeState_NODE_STATE_STALE {
		writeError(w, http.StatusServiceUnavailable,
			"sandbox %q is unreachable: its node %s has not reported for %s and the sandbox is lost unless the node comes back",
			id, l.Node.GetId(), (time.Duration(l.HeartbeatAgeMs) * time.Millisecond).Round(time.Second))
		return
	}
	t, err := targetOf(l.Node)
	if err != nil {
		writeError(w, http.StatusBadGateway, "%v", err)
		return
	}
	t.sandbox = id
	g.routes.put(id, t, now)
	g.forward(w, r, t)
}

// lookup asks the scheduler which node holds sandbox id. A scheduler that cannot answer
// yet says Unavailable: a new leader learning the cluster from the nodes' heartbeats (it
// knows every live node's sandboxes after one heartbeat), or the replica the gateway
// spoke to has just died. Such answers are retried until another comes or
// schedulerTimeout passes, so a scheduler failover shows to users as a call slower by a
// heartbeat or two, not as an error.
func (g *Gateway) lookup(ctx context.Context, id string) (*pb.LookupResponse, error) {
	ctx, cancel := context.WithTimeout(ctx, schedulerTimeout)
	defer cancel()
	for wait := 50 * time.Millisecond; ; wait = min(2*wait, 500*time.Millisecond) {
		l, err := g.sched.Lookup(ctx, &pb.LookupRequest{SandboxId: id})
		if status.Code(err) != codes.Unavailable {
			return l, err
		}
		select {
		case <-ctx.Done():
			return nil, err
		case <-time.After(wait):
		}
	}
}

// liveNodes lists the nodes with fresh heartbeats (ready or draining), ordered by id.
func (g *Gateway) liveNodes(ctx context.Context) ([]*target, error) {
	ctx, cancel := context.WithTimeout(ctx, schedulerTimeout)
	defer cancel()
	resp, err := g.sched.ListNodes(ctx, &pb.ListNodesRequest{})
	if err != nil {
		return nil, err
	}
	var out []*target
	for _, n := range resp.Nodes {
		if n.State == pb.NodeState_NODE_STATE_STALE {
			continue
		}
		t, err := targetOf(n.Node)
		if err != nil {
			g.log.Warn("skip node", "err", err)
			continue
		}
		out = append(out, t)
	}
	sort.Slice(out, func(i, j int) bool { return out[i].node < out[j].node })
	return out, nil
}

// toAnyNode forwards a call that any node answers alike (templates live in the shared
// repository): the first live node, so repeated calls land on the same one.
func (g *Gateway) toAnyNode(w http.ResponseWriter, r *http.Request) {
	nodes, err := g.liveNodes(r.Context())
	if err != nil {
		g.schedulerError(w, "list nodes", err)
		return
	}
	if len(nodes) == 0 {
		writeError(w, http.StatusServiceUnavailable, "no live node in the cluster")
		return
	}
	g.forward(w, r, nodes[0])
}

// signedFile serves a signed /files URL, which names no sandbox: the node whose sandbox's
// token reproduces the signature answers; the others answer 401.
func (g *Gateway) signedFile(w http.ResponseWriter, r *http.Request) {
	if r.Method != http.MethodGet && r.Method != http.MethodHead {
		// An upload's body can be sent once: it needs the sandbox header.
		writeError(w, http.StatusBadRequest, "signed uploads through the gateway need the %s header", headerSandboxID)
		return
	}
	nodes, err := g.liveNodes(r.Context())
	if err != nil {
		g.schedulerError(w, "list nodes", err)
		return
	}
	for _, t := range nodes {
		req := r.Clone(r.Context())
		req.RequestURI = ""
		req.URL.Scheme, req.URL.Host = t.base.Scheme, t.base.Host
		resp, err := g.client.Do(req)
		if err != nil {
			continue
		}
		if resp.StatusCode == http.StatusUnauthorized {
			resp.Body.Close()
			continue
		}
		copyResponse(w, resp)
		return
	}
	writeError(w, http.StatusUnauthorized, "the URL signature does not match any sandbox")
}

// schedulerError maps a failed scheduler call to an HTTP answer.
func (g *Gateway) schedulerError(w http.ResponseWriter, what string, err error) {
	code := http.StatusBadGateway
	switch status.Code(err) {
	case codes.InvalidArgument:
		code = http.StatusBadRequest
	case codes.Unavailable, codes.ResourceExhausted, codes.DeadlineExceeded:
		code = http.StatusServiceUnavailable
	}
	writeError(w, code, "%s: scheduler: %s", what, status.Convert(err).Message())
}
