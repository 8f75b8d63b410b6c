package process

import (
	"sync"

	pb "github.com/aenv-dev/aenv/internal/envd/gen/process"
)

// hub fans a process's events out to every attached stream (the Start stream and any Connect
// streams). Delivery blocks until each subscriber took the event or detached, so a slow client slows
// the process (pipe back-pressure) instead of losing output; with no subscriber output is dropped.
type hub struct {
	mu     sync.Mutex
	subs   []*subscriber // copy-on-write
	closed bool
	end    *pb.ProcessEvent
}

type subscriber struct {
	ch   chan *pb.ProcessEvent
	gone chan struct{}
	once sync.Once
}

// subscribe attaches a subscriber; when the process already ended it returns the end event instead.
func (h *hub) subscribe() (*subscriber, *pb.ProcessEvent) {
	h.mu.Lock()
	defer h.mu.Unlock()
	if h.closed {
		return nil, h.end
	}
	s := &subscriber{ch: make(chan *pb.ProcessEvent, 16), gone: make(chan struct{})}
	subs := make([]*subscriber, len(h.subs), len(h.subs)+1)
	copy(subs, h.subs)
	h.subs = append(subs, s)
	return s, nil
}

func (h *hub) unsubscribe(s *subscriber) {
	s.once.Do(func() { close(s.gone) })
	h.mu.Lock()
	defer h.mu.Unlock()
	for i, x := range h.subs {
		if x == s {
			subs := make([]*subscriber, 0, len(h.subs)-1)
			subs = append(subs, h.subs[:i]...)
			h.subs = append(subs, h.subs[i+1:]...)
			return
		}
	}
}

func (h *hub) publish(ev *pb.ProcessEvent) {
	h.mu.Lock()
	subs := h.subs
	h.mu.Unlock()
	for _, s := range subs {
		select {
		case s.ch <- ev:
		case <-s.gone:
		}
	}
}

// close delivers the end event to every subscriber; later subscribers get it from subscribe.
// It must be called once, after the last publish.
func (h *hub) close(end *pb.ProcessEvent) {
	h.mu.Lock()
	h.closed = true
	h.end = end
	subs := h.subs
	h.subs = nil
	h.mu.Unlock()
	for _, s := range subs {
		select {
		case s.ch <- end:
		case <-s.gone:
		}
	}
}
