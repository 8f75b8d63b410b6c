package kube_test

import (
	"context"
	"fmt"
	"strings"
	"sync"
	"testing"
	"time"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/aenv-dev/aenv/internal/cluster/kube"
	"github.com/aenv-dev/aenv/internal/cluster/kube/kubetest"
)

// recorder is a Replica that remembers its role.
type recorder struct {
	mu      sync.Mutex
	leading bool
	leader  string
	leads   int
}

func (r *recorder) Lead() {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.leading, r.leader = true, ""
	r.leads++
}

func (r *recorder) Follow(addr string) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.leading, r.leader = false, addr
}

func (r *recorder) role() (bool, string, int) {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.leading, r.leader, r.leads
}

// Two replicas campaign for one Lease on a real API server: exactly one leads and the
// other follows its address; when the leader stops, it releases the Lease and the other
// takes over at once instead of waiting for the lease to expire.
func TestElection(t *testing.T) {
	kc := kubetest.Start(t)
	const ns, lease = "default", "aenv-scheduler-test"
	stop := map[*recorder]func(){}
	start := func(addr string) *recorder {
		r := &recorder{}
		ctx, cancel := context.WithCancel(context.Background())
		done := make(chan struct{})
		go func() {
			defer close(done)
			err := kube.RunElection(ctx, kc.Client, kube.Election{Namespace: ns, Lease: lease, Address: addr,
				LeaseDuration: 60 * time.Second, RenewDeadline: 40 * time.Second, RetryPeriod: 200 * time.Millisecond}, r)
			if err != nil {
				t.Error(err)
			}
		}()
		stop[r] = func() { cancel(); <-done }
		t.Cleanup(stop[r])
		return r
	}
	a := start("10.0.0.1:9090")
	b := start("10.0.0.2:9090")

	var leader, follower *recorder
	var leaderAddr string
	eventually(t, "one replica leads, the other follows it", func() error {
		la, fa, _ := a.role()
		lb, fb, _ := b.role()
		switch {
		case la && !lb && fb == "10.0.0.1:9090":
			leader, follower, leaderAddr = a, b, "10.0.0.1:9090"
		case lb && !la && fa == "10.0.0.2:9090":
			leader, follower, leaderAddr = b, a, "10.0.0.2:9090"
		default:
			return fmt.Errorf("a: leading %v following %q; b: leading %v following %q", la, fa, lb, fb)
		}
		return nil
	})
	l, err := kc.Client.CoordinationV1().Leases(ns).Get(context.Background(), lease, metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	if h := *l.Spec.HolderIdentity; !strings.HasPrefix(h, leaderAddr+"#") {
		t.Fatalf("Lease holder %q, want the leader %s", h, leaderAddr)
	}

	// The leader stops (a graceful shutdown): the follower takes over within eventually's
	// 20 s, which it could not by waiting out the 60 s lease: the Lease was released.
	stop[leader]()
	eventually(t, "the follower takes over", func() error {
		if l, _, n := follower.role(); !l || n != 1 {
			return fmt.Errorf("follower leading %v after %d terms", l, n)
		}
		return nil
	})
	if l, _, _ := leader.role(); l {
		t.Fatal("the stopped replica still leads")
	}
}

func TestElectionNeedsAddress(t *testing.T) {
	if err := kube.RunElection(context.Background(), nil, kube.Election{Lease: "x"}, &recorder{}); err == nil {
		t.Fatal("an election without this replica's address must fail")
	}
}
