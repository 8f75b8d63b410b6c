package scheduler

import (
	"sync"
	"time"

	pb "github.com/aenv-dev/aenv/internal/cluster/scheduler/gen/schedulerv1"
)

// subscriberBuffer is how many events a watcher may fall behind before it is cut off;
// a watcher that cannot keep up must re-list rather than silently miss events.
const subscriberBuffer = 1024

// broadcaster fans events out to watchers without ever blocking the publisher.
type broadcaster struct {
	mu   sync.Mutex
	subs map[*subscription]struct{}
}

type subscription struct {
	C chan *pb.Event
	// lagged is closed when the subscriber fell behind and was dropped.
	lagged chan struct{}
}

func newBroadcaster() *broadcaster { return &broadcaster{subs: map[*subscription]struct{}{}} }

func (b *broadcaster) subscribe() *subscription {
	sub := &subscription{C: make(chan *pb.Event, subscriberBuffer), lagged: make(chan struct{})}
	b.mu.Lock()
	b.subs[sub] = struct{}{}
	b.mu.Unlock()
	return sub
}

func (b *broadcaster) unsubscribe(sub *subscription) {
	b.mu.Lock()
	delete(b.subs, sub)
	b.mu.Unlock()
}

func (b *broadcaster) publish(now time.Time, evs ...*pb.Event) {
	if len(evs) == 0 {
		return
	}
	b.mu.Lock()
	defer b.mu.Unlock()
	for _, e := range evs {
		e.UnixMs = now.UnixMilli()
		for sub := range b.subs {
			select {
			case sub.C <- e:
			default:
				delete(b.subs, sub)
				close(sub.lagged)
			}
		}
	}
}
