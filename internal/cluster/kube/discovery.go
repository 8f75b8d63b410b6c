package kube

import (
	"context"
	"fmt"
	"log/slog"
	"sort"
	"sync"
	"time"

	discoveryv1 "k8s.io/api/discovery/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/labels"
	"k8s.io/client-go/informers"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/tools/cache"

	"github.com/aenv-dev/aenv/internal/cluster/scheduler"
)

// MemberSink receives the discovered node set on every change: a scheduler State.
type MemberSink interface {
	SetMembers([]scheduler.Member)
}

// NodeID names the node an EndpointSlice endpoint stands for, the id its `aenv serve`
// heartbeats under: the Kubernetes node it runs on (the DaemonSet sets
// cluster.node_id from spec.nodeName), else the Pod, else its first address.
func NodeID(ep discoveryv1.Endpoint) string {
	switch {
	case ep.NodeName != nil && *ep.NodeName != "":
		return *ep.NodeName
	case ep.TargetRef != nil && ep.TargetRef.Name != "":
		return ep.TargetRef.Name
	case len(ep.Addresses) > 0:
		return ep.Addresses[0]
	}
	return ""
}

// Members turns EndpointSlices into the member list: every endpoint is a member; it
// serves unless Kubernetes reports it terminating or not serving. An endpoint listed
// twice (dual-stack slices) serves if any listing does.
func Members(slices []*discoveryv1.EndpointSlice) []scheduler.Member {
	serving := map[string]bool{}
	for _, s := range slices {
		for _, ep := range s.Endpoints {
			id := NodeID(ep)
			if id == "" {
				continue
			}
			c := ep.Conditions
			ok := (c.Serving == nil || *c.Serving) && (c.Terminating == nil || !*c.Terminating)
			serving[id] = serving[id] || ok
		}
	}
	out := make([]scheduler.Member, 0, len(serving))
	for id, ok := range serving {
		out = append(out, scheduler.Member{ID: id, Serving: ok})
	}
	sort.Slice(out, func(i, j int) bool { return out[i].ID < out[j].ID })
	return out
}

// WatchNodes keeps sink's members equal to the endpoints of Service service in namespace
// (its EndpointSlices, through a client-go informer) until ctx ends. It returns once the
// first full list has been applied, or with an error when that fails within timeout
// (RBAC: list and watch endpointslices.discovery.k8s.io).
func WatchNodes(ctx context.Context, cs kubernetes.Interface, namespace, service string, sink MemberSink,
	timeout time.Duration, log *slog.Logger) error {
	if log == nil {
		log = slog.Default()
	}
	selector := labels.Set{discoveryv1.LabelServiceName: service}.String()
	f := informers.NewSharedInformerFactoryWithOptions(cs, 0, informers.WithNamespace(namespace),
		informers.WithTweakListOptions(func(o *metav1.ListOptions) { o.LabelSelector = selector }))
	inf := f.Discovery().V1().EndpointSlices()
	lister := inf.Lister().EndpointSlices(namespace)
	synced := make(chan struct{})
	var mu sync.Mutex // a list and its SetMembers go together: the newest list lands last
	apply := func() {
		select {
		case <-synced:
		default:
			return // the initial list is applied once, in full, below
		}
		mu.Lock()
		defer mu.Unlock()
		slices, err := lister.List(labels.Everything())
		if err != nil {
			log.Error("list node EndpointSlices", "err", err)
			return
		}
		m := Members(slices)
		sink.SetMembers(m)
		log.Debug("discovered nodes", "service", namespace+"/"+service, "members", len(m))
	}
	if _, err := inf.Informer().AddEventHandler(cache.ResourceEventHandlerFuncs{
		AddFunc:    func(any) { apply() },
		UpdateFunc: func(any, any) { apply() },
		DeleteFunc: func(any) { apply() },
	}); err != nil {
		return fmt.Errorf("watch EndpointSlices: %w", err)
	}
	f.Start(ctx.Done())
	go func() { <-ctx.Done(); f.Shutdown() }()
	sctx, cancel := context.WithTimeout(ctx, timeout)
	defer cancel()
	if !cache.WaitForCacheSync(sctx.Done(), inf.Informer().HasSynced) {
		return fmt.Errorf("list the EndpointSlices of Service %s/%s within %s (may the scheduler's service account list and watch endpointslices.discovery.k8s.io?)",
			namespace, service, timeout)
	}
	close(synced)
	apply()
	log.Info("discovering nodes from EndpointSlices", "service", namespace+"/"+service)
	return nil
}
