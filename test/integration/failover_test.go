package integration

import (
	"context"
	"fmt"
	"net/http"
	"strings"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/aenv-dev/aenv/internal/bench"
	"github.com/aenv-dev/aenv/internal/cluster/kube/kubetest"
	"github.com/aenv-dev/aenv/internal/cluster/scheduler"
	pb "github.com/aenv-dev/aenv/internal/cluster/scheduler/gen/schedulerv1"
)

// Two `aenv scheduler` processes elect a leader through a Lease on a real API server
// (etcd + kube-apiserver); a node (listed statically) and a gateway talk to both. The
// leader is killed with SIGKILL, so it cannot release the Lease: the other replica takes
// it once it expires, learns the cluster from the node's heartbeats, and the gateway
// routes to the sandbox again and places new ones.
func TestSchedulerFailover(t *testing.T) {
	bins := needNode(t)
	kc := kubetest.Start(t)
	ctx, cancel := context.WithTimeout(context.Background(), 4*time.Minute)
	defer cancel()
	const lease, nodeID = "aenv-it-scheduler", "it-ha-node"

	scheds := map[string]*daemon{}
	var addrs []string
	for range 2 {
		addr := fmt.Sprintf("127.0.0.1:%d", freePort(t))
		conn, err := grpc.NewClient(addr, grpc.WithTransportCredentials(insecure.NewCredentials()))
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { conn.Close() })
		hc := healthpb.NewHealthClient(conn)
		scheds[addr] = startDaemon(t, bins, nil, func() bool {
			cctx, ccancel := context.WithTimeout(ctx, time.Second)
			defer ccancel()
			r, err := hc.Check(cctx, &healthpb.HealthCheckRequest{})
			return err == nil && r.Status == healthpb.HealthCheckResponse_SERVING
		}, "scheduler", "--listen", addr, "--heartbeat-interval", "500ms", "--stale-after", "3s",
			"--kubeconfig", kc.Kubeconfig, "--namespace", "default", "--lease", lease,
			"--lease-duration", "4s", "--renew-deadline", "3s", "--retry-period", "250ms", "--nodes", nodeID)
		scheds[addr].addr = addr
		addrs = append(addrs, addr)
	}
	both := strings.Join(addrs, ",")
	conn, err := scheduler.Dial(both)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { conn.Close() })
	sc := pb.NewSchedulerClient(conn)

	key := "e2b_" + randHex(20)
	clusterNode(t, both, nodeID, key, "AENV_CLUSTER_CPU_COUNT=16", "AENV_CLUSTER_MEMORY_MB=16384")
	gwAddr := fmt.Sprintf("127.0.0.1:%d", freePort(t))
	gwURL := "http://" + gwAddr
	startDaemon(t, bins, []string{"AENV_API_KEY=" + key}, func() bool {
		resp, err := http.Get(gwURL + "/health")
		if err != nil {
			return false
		}
		resp.Body.Close()
		return resp.StatusCode == http.StatusNoContent
	}, "gateway", "--listen", gwAddr, "--scheduler", both)
	gw := bench.NewClient(gwURL, key, 4)
	t.Cleanup(gw.Close)

	holder := func() string {
		l, err := kc.Client.CoordinationV1().Leases("default").Get(ctx, lease, metav1.GetOptions{})
		if err != nil || l.Spec.HolderIdentity == nil {
			return ""
		}
		addr, _, _ := strings.Cut(*l.Spec.HolderIdentity, "#")
		return addr
	}
	waitUntil(t, 30*time.Second, "a leader and the node registered", func() error {
		if holder() == "" {
			return fmt.Errorf("no Lease holder")
		}
		n, err := sc.ListNodes(ctx, &pb.ListNodesRequest{})
		if err != nil || len(n.Nodes) != 1 {
			return fmt.Errorf("nodes %v, %v", n, err)
		}
		return nil
	})
	sb, err := gw.Create(ctx, bench.CreateRequest{TemplateID: "base", Timeout: 300})
	if err != nil {
		t.Fatal(err)
	}
	status := func(id string) int {
		req, _ := http.NewRequestWithContext(ctx, http.MethodGet, gwURL+"/sandboxes/"+id, nil)
		req.Header.Set("X-API-Key", key)
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			return 0
		}
		resp.Body.Close()
		return resp.StatusCode
	}
	if s := status(sb.ID); s != http.StatusOK {
		t.Fatalf("GET the new sandbox through the gateway: %d", s)
	}

	old := holder()
	killed := time.Now()
	if err := scheds[old].cmd.Process.Kill(); err != nil {
		t.Fatal(err)
	}
	var survivor string
	for _, a := range addrs {
		if a != old {
			survivor = a
		}
	}
	waitUntil(t, 30*time.Second, "the other replica takes the Lease", func() error {
		if h := holder(); h != survivor {
			return fmt.Errorf("holder %q", h)
		}
		return nil
	})
	took := time.Since(killed)
	waitUntil(t, 30*time.Second, "routing to the sandbox recovers", func() error {
		if s := status(sb.ID); s != http.StatusOK {
			return fmt.Errorf("GET /sandboxes/%s through the gateway: %d", sb.ID, s)
		}
		return nil
	})
	recovered := time.Since(killed)
	t.Logf("leader killed: Lease taken over after %s, routing recovered after %s (lease duration 4 s)", took.Round(time.Millisecond), recovered.Round(time.Millisecond))
	l, err := sc.Lookup(ctx, &pb.LookupRequest{SandboxId: sb.ID})
	if err != nil || l.Node.Id != nodeID {
		t.Fatalf("Lookup on the new leader = %v, %v", l, err)
	}
	sb2, err := gw.Create(ctx, bench.CreateRequest{TemplateID: "base", Timeout: 300})
	if err != nil {
		t.Fatalf("create after the failover: %v", err)
	}
	for _, id := range []string{sb.ID, sb2.ID} {
		if err := gw.Kill(ctx, id); err != nil {
			t.Errorf("kill %s: %v", id, err)
		}
	}
}

// waitUntil polls cond until it succeeds or d passes.
func waitUntil(t *testing.T, d time.Duration, what string, cond func() error) {
	t.Helper()
	deadline := time.Now().Add(d)
	for {
		err := cond()
		if err == nil {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("%s: %v", what, err)
		}
		time.Sleep(100 * time.Millisecond)
	}
}
