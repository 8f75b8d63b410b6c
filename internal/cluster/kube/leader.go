package kube

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"fmt"
	"log/slog"
	"strings"
	"time"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/tools/leaderelection"
	"k8s.io/client-go/tools/leaderelection/resourcelock"
)

// Replica is what the election drives: a scheduler server.
type Replica interface {
	// Lead starts serving calls with a fresh state.
	Lead()
	// Follow forwards calls to the leader at addr ("" while none is known).
	Follow(addr string)
}

// Election configures leader election through a Lease.
type Election struct {
	Namespace, Lease string
	// Address is this replica's gRPC address as the other replicas dial it; it is the
	// part of the Lease's holderIdentity before '#' (after it, a per-process id).
	Address string
	// LeaseDuration, RenewDeadline and RetryPeriod as in client-go (defaults 15s, 10s,
	// 2s): a leader killed without releasing the Lease is replaced after LeaseDuration.
	LeaseDuration, RenewDeadline, RetryPeriod time.Duration
	Log                                       *slog.Logger
}

// identity is holderIdentity for a replica at addr: a restarted process gets a new one,
// so it never mistakes its predecessor's Lease for its own.
func identity(addr string) string {
	var b [6]byte
	_, _ = rand.Read(b[:])
	return addr + "#" + hex.EncodeToString(b[:])
}

// addressOf returns the gRPC address in a holderIdentity.
func addressOf(id string) string {
	addr, _, _ := strings.Cut(id, "#")
	return addr
}

// RunElection campaigns for the Lease until ctx ends, making r lead while it holds the
// Lease and follow the holder otherwise. It starts r as a follower. On return (ctx
// ended) a held Lease has been released, so another replica takes over at once.
func RunElection(ctx context.Context, cs kubernetes.Interface, e Election, r Replica) error {
	if e.Lease == "" || e.Address == "" {
		return fmt.Errorf("leader election needs a Lease name and this replica's address")
	}
	if e.LeaseDuration <= 0 {
		e.LeaseDuration = 15 * time.Second
	}
	if e.RenewDeadline <= 0 {
		e.RenewDeadline = e.LeaseDuration * 2 / 3
	}
	if e.RetryPeriod <= 0 {
		e.RetryPeriod = e.RenewDeadline / 5
	}
	log := e.Log
	if log == nil {
		log = slog.Default()
	}
	id := identity(e.Address)
	r.Follow("")
	lock := &resourcelock.LeaseLock{
		LeaseMeta:  metav1.ObjectMeta{Namespace: e.Namespace, Name: e.Lease},
		Client:     cs.CoordinationV1(),
		LockConfig: resourcelock.ResourceLockConfig{Identity: id},
	}
	for ctx.Err() == nil {
		var le *leaderelection.LeaderElector
		le, err := leaderelection.NewLeaderElector(leaderelection.LeaderElectionConfig{
			Lock:            lock,
			Name:            e.Lease,
			LeaseDuration:   e.LeaseDuration,
			RenewDeadline:   e.RenewDeadline,
			RetryPeriod:     e.RetryPeriod,
			ReleaseOnCancel: true,
			Callbacks: leaderelection.LeaderCallbacks{
				OnStartedLeading: func(context.Context) {
					log.Info("acquired the scheduler Lease", "lease", e.Namespace+"/"+e.Lease, "identity", id)
					r.Lead()
				},
				// Also called when this elector never led: following nobody until the next
				// elector observes the holder is right in both cases.
				OnStoppedLeading: func() { r.Follow("") },
				OnNewLeader: func(holder string) {
					// Reports run on their own goroutines: one about an older holder may
					// arrive after this replica took the Lease.
					if holder == id || le.IsLeader() {
						return
					}
					r.Follow(addressOf(holder))
				},
			},
		})
		if err != nil {
			return fmt.Errorf("leader election: %w", err)
		}
		le.Run(ctx)
	}
	return nil
}
