package kube_test

import (
	"context"
	"errors"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	discoveryv1 "k8s.io/api/discovery/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/aenv-dev/aenv/internal/cluster/kube"
	"github.com/aenv-dev/aenv/internal/cluster/kube/kubetest"
	"github.com/aenv-dev/aenv/internal/cluster/scheduler"
	pb "github.com/aenv-dev/aenv/internal/cluster/scheduler/gen/schedulerv1"
)

func ptr[T any](v T) *T { return &v }

// endpoint is one node pod behind the nodes' Service.
func endpoint(node, ip string, ready, terminating bool) discoveryv1.Endpoint {
	return discoveryv1.Endpoint{
		Addresses:  []string{ip},
		NodeName:   ptr(node),
		Conditions: discoveryv1.EndpointConditions{Ready: ptr(ready), Serving: ptr(ready), Terminating: ptr(terminating)},
	}
}

func slice(name, service string, eps ...discoveryv1.Endpoint) *discoveryv1.EndpointSlice {
	return &discoveryv1.EndpointSlice{
		ObjectMeta:  metav1.ObjectMeta{Name: name, Labels: map[string]string{discoveryv1.LabelServiceName: service}},
		AddressType: discoveryv1.AddressTypeIPv4,
		Ports:       []discoveryv1.EndpointPort{{Name: ptr("http"), Port: ptr(int32(8000))}},
		Endpoints:   eps,
	}
}

func heartbeat(s *scheduler.State, id string) error {
	return s.Heartbeat(&pb.HeartbeatRequest{Node: &pb.NodeInfo{Id: id, Endpoint: "http://" + id + ":8000"}})
}

// eventually polls cond for up to 20 s (informer events arrive asynchronously).
func eventually(t *testing.T, what string, cond func() error) {
	t.Helper()
	deadline := time.Now().Add(20 * time.Second)
	for {
		err := cond()
		if err == nil {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("%s: %v", what, err)
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// placeable reports the nodes a placement may pick, by placing many times.
func placeable(s *scheduler.State) map[string]bool {
	got := map[string]bool{}
	for i := 0; i < 40; i++ {
		if p, err := s.Place(&pb.PlaceRequest{}); err == nil {
			got[p.Node.Id] = true
			s.Release(p.ReservationId)
		}
	}
	return got
}

// The scheduler's nodes follow the EndpointSlices of the nodes' Service on a real API
// server: listed nodes join, terminating or unready ones get no placements, unlisted ones
// are refused, and changes apply as they happen.
func TestWatchNodes(t *testing.T) {
	kc := kubetest.Start(t)
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	const ns = "default"
	slices := kc.Client.DiscoveryV1().EndpointSlices(ns)
	if _, err := slices.Create(ctx, slice("aenv-nodes-a", "aenv-nodes",
		endpoint("node-a", "10.0.0.1", true, false), endpoint("node-b", "10.0.0.2", false, true)), metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	// Another Service's endpoints are not nodes.
	if _, err := slices.Create(ctx, slice("other-x", "other", endpoint("node-x", "10.0.0.9", true, false)), metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}

	state := scheduler.New(scheduler.Config{})
	wctx, stop := context.WithCancel(ctx)
	defer stop()
	if err := kube.WatchNodes(wctx, kc.Client, ns, "aenv-nodes", state, 30*time.Second, nil); err != nil {
		t.Fatal(err)
	}
	// The first list is applied before WatchNodes returns.
	for _, id := range []string{"node-a", "node-b"} {
		if err := heartbeat(state, id); err != nil {
			t.Fatalf("heartbeat from discovered %s: %v", id, err)
		}
	}
	for _, id := range []string{"node-c", "node-x"} {
		if err := heartbeat(state, id); !errors.Is(err, scheduler.ErrUnknownNode) {
			t.Fatalf("heartbeat from undiscovered %s = %v, want refused", id, err)
		}
	}
	if got := placeable(state); len(got) != 1 || !got["node-a"] {
		t.Fatalf("placeable = %v, want only node-a (node-b is terminating)", got)
	}

	// node-c's pod starts on another slice of the Service; node-b is gone, node-a stops serving.
	if _, err := slices.Create(ctx, slice("aenv-nodes-b", "aenv-nodes", endpoint("node-c", "10.0.0.3", true, false)), metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	a, err := slices.Get(ctx, "aenv-nodes-a", metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	a.Endpoints = []discoveryv1.Endpoint{endpoint("node-a", "10.0.0.1", false, false)}
	if _, err := slices.Update(ctx, a, metav1.UpdateOptions{}); err != nil {
		t.Fatal(err)
	}
	eventually(t, "node-c joins", func() error { return heartbeat(state, "node-c") })
	eventually(t, "node-b is refused", func() error {
		if err := heartbeat(state, "node-b"); !errors.Is(err, scheduler.ErrUnknownNode) {
			return errors.New("still admitted")
		}
		return nil
	})
	eventually(t, "only node-c serves", func() error {
		if got := placeable(state); len(got) != 1 || !got["node-c"] {
			return errors.New("placeable nodes differ")
		}
		return nil
	})

	// The Service's slices deleted: no node may join.
	for _, name := range []string{"aenv-nodes-a", "aenv-nodes-b"} {
		if err := slices.Delete(ctx, name, metav1.DeleteOptions{}); err != nil {
			t.Fatal(err)
		}
	}
	eventually(t, "every node is refused", func() error {
		if err := heartbeat(state, "node-c"); !errors.Is(err, scheduler.ErrUnknownNode) {
			return errors.New("node-c still admitted")
		}
		return nil
	})
}

// Discovery of a Service with no EndpointSlices (yet) admits no node.
func TestWatchNodesMissingService(t *testing.T) {
	kc := kubetest.Start(t)
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	// A namespace that does not exist lists nothing: discovery starts, with no members.
	state := scheduler.New(scheduler.Config{})
	if err := kube.WatchNodes(ctx, kc.Client, "no-such-ns", "aenv-nodes", state, 10*time.Second, nil); err != nil {
		t.Fatal(err)
	}
	if err := heartbeat(state, "node-a"); !errors.Is(err, scheduler.ErrUnknownNode) {
		t.Fatalf("heartbeat with no discovered node = %v", err)
	}
}

func TestMembers(t *testing.T) {
	for _, tc := range []struct {
		name string
		eps  []discoveryv1.Endpoint
		want []scheduler.Member
	}{
		{"ready", []discoveryv1.Endpoint{endpoint("a", "10.0.0.1", true, false)}, []scheduler.Member{{ID: "a", Serving: true}}},
		{"terminating", []discoveryv1.Endpoint{endpoint("a", "10.0.0.1", true, true)}, []scheduler.Member{{ID: "a"}}},
		{"not ready", []discoveryv1.Endpoint{endpoint("a", "10.0.0.1", false, false)}, []scheduler.Member{{ID: "a"}}},
		{"no conditions", []discoveryv1.Endpoint{{Addresses: []string{"10.0.0.1"}, NodeName: ptr("a")}}, []scheduler.Member{{ID: "a", Serving: true}}},
		{"pod name without node name", []discoveryv1.Endpoint{{Addresses: []string{"10.0.0.1"},
			TargetRef: &corev1.ObjectReference{Kind: "Pod", Name: "aenv-node-x1"}}}, []scheduler.Member{{ID: "aenv-node-x1", Serving: true}}},
		{"address only", []discoveryv1.Endpoint{{Addresses: []string{"10.0.0.1"}}}, []scheduler.Member{{ID: "10.0.0.1", Serving: true}}},
		{"listed twice, one serving", []discoveryv1.Endpoint{endpoint("a", "10.0.0.1", false, true), endpoint("a", "fd00::1", true, false)},
			[]scheduler.Member{{ID: "a", Serving: true}}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			got := kube.Members([]*discoveryv1.EndpointSlice{slice("s", "aenv-nodes", tc.eps...)})
			if len(got) != len(tc.want) {
				t.Fatalf("Members = %v, want %v", got, tc.want)
			}
			for i := range got {
				if got[i] != tc.want[i] {
					t.Fatalf("Members = %v, want %v", got, tc.want)
				}
			}
		})
	}
}
