package p2p

import (
	"context"
	"fmt"

	"google.golang.org/grpc"

	pb "github.com/aenv-dev/aenv/internal/cluster/scheduler/gen/schedulerv1"
	"github.com/aenv-dev/aenv/internal/repository"
)

// PeerClient is the part of the scheduler client SchedulerPeers uses.
type PeerClient interface {
	ListPeers(ctx context.Context, req *pb.ListPeersRequest, opts ...grpc.CallOption) (*pb.ListPeersResponse, error)
}

// SchedulerPeers lists peers through the scheduler's ListPeers: the fresh nodes whose
// heartbeats report the layer, this node (Self, its node id) excluded.
type SchedulerPeers struct {
	Client PeerClient
	Self   string
}

// Peers implements PeerLister.
func (s SchedulerPeers) Peers(ctx context.Context, layer repository.Digest) ([]string, error) {
	resp, err := s.Client.ListPeers(ctx, &pb.ListPeersRequest{Layer: string(layer), ExcludeNodeId: s.Self})
	if err != nil {
		return nil, fmt.Errorf("p2p: list the peers of %s: %w", layer, err)
	}
	var out []string
	for _, n := range resp.GetPeers() {
		if u := n.GetP2PEndpoint(); u != "" {
			out = append(out, u)
		}
	}
	return out, nil
}
