package catalog

import (
	"fmt"
	"sync"

	bolt "go.etcd.io/bbolt"
)

// groupCommit runs small writes in shared transactions: a write that arrives while
// another transaction commits waits for it and then commits together with every write
// that arrived meanwhile, in one transaction and one fsync. A write that finds nothing
// in flight commits at once, alone, so a lone write waits for no timer (bbolt's Batch
// waits up to its MaxBatchDelay for company). Each write is durable when do returns.
//
// A burst of creates writes one record each; bbolt serializes its writers, and each
// commit is an fsync, so the burst's last record waited for all the others' fsyncs.
type groupCommit struct {
	db *bolt.DB

	mu      sync.Mutex
	pending []*groupWrite
	leading bool // a goroutine is committing pending writes
}

type groupWrite struct {
	fn   func(*bolt.Tx) error
	done chan error
}

// do runs fn in a read-write transaction shared with the writes around it; fn must
// only write, may run more than once (when another write of its group fails, the group
// is committed again without that one), and its error fails only its own write.
func (g *groupCommit) do(fn func(*bolt.Tx) error) error {
	w := &groupWrite{fn: fn, done: make(chan error, 1)}
	g.mu.Lock()
	g.pending = append(g.pending, w)
	if g.leading {
		g.mu.Unlock()
		return <-w.done
	}
	g.leading = true
	for len(g.pending) > 0 {
		group := g.pending
		g.pending = nil
		g.mu.Unlock()
		g.commit(group)
		g.mu.Lock()
	}
	g.leading = false
	g.mu.Unlock()
	return <-w.done
}

// commit commits group in one transaction. A write whose fn fails gets its error and
// is left out; the others are committed again without it (bbolt cannot roll back one
// write of a transaction). A failed commit fails every write of the group.
func (g *groupCommit) commit(group []*groupWrite) {
	for len(group) > 0 {
		failed := -1
		var ferr error
		err := func() (err error) {
			// A panicking write must not leave the others waiting forever (the API
			// server recovers its handlers' panics): it fails its group.
			defer func() {
				if r := recover(); r != nil {
					failed, err = -1, fmt.Errorf("catalog: write panicked: %v", r)
				}
			}()
			return g.db.Update(func(tx *bolt.Tx) error {
				for i, w := range group {
					if err := w.fn(tx); err != nil {
						failed, ferr = i, err
						return err
					}
				}
				return nil
			})
		}()
		if failed < 0 {
			for _, w := range group {
				w.done <- err
			}
			return
		}
		group[failed].done <- ferr
		group = append(group[:failed:failed], group[failed+1:]...)
	}
}
