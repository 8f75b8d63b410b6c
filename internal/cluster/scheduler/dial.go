package scheduler

import (
	"fmt"
	"strings"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/resolver"
	"google.golang.org/grpc/resolver/manual"
)

// Round robin skips a replica whose connection failed at once, where pick_first would
// first try to reconnect to it.
var roundRobin = grpc.WithDefaultServiceConfig(`{"loadBalancingConfig":[{"round_robin":{}}]}`)

// Dial connects to the scheduler replicas at target: one address (a DNS name resolves to
// every replica behind it, as a headless Service's does) or a comma-separated list.
// Calls are spread over the reachable replicas, skipping one that fails; any replica
// serves any call (followers forward to the leader).
func Dial(target string) (*grpc.ClientConn, error) {
	var addrs []string
	for _, a := range strings.Split(target, ",") {
		if a = strings.TrimSpace(a); a != "" {
			addrs = append(addrs, a)
		}
	}
	creds := grpc.WithTransportCredentials(insecure.NewCredentials())
	switch len(addrs) {
	case 0:
		return nil, fmt.Errorf("no scheduler address in %q", target)
	case 1:
		return grpc.NewClient(addrs[0], creds, roundRobin)
	}
	r := manual.NewBuilderWithScheme("aenv-schedulers")
	state := resolver.State{}
	for _, a := range addrs {
		state.Addresses = append(state.Addresses, resolver.Address{Addr: a})
	}
	r.InitialState(state)
	return grpc.NewClient(r.Scheme()+":///schedulers", creds, grpc.WithResolvers(r), roundRobin)
}
