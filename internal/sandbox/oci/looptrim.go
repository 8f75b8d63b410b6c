package oci

import (
	"time"

	"github.com/aenv-dev/aenv/internal/storage/blockdev"
)

// loopReserve is how many free loop devices the node leaves for the creates to come: a
// burst beyond it makes devices anew (~0.1 ms of CPU each, see blockdev.TrimFreeLoops).
const loopReserve = 32

// loopTrimEvery is how often the node gives back the free loop devices beyond
// loopReserve that its sandboxes' roots left (or a node before it, or anything else on
// the host).
const loopTrimEvery = 30 * time.Second

// loopKeepStopped is how many free loop devices a node that stops leaves: as many as the
// kernel makes at boot (the loop driver's max_loop default).
const loopKeepStopped = 8

// startLoopTrim trims free loop devices at once and then every loopTrimEvery until the
// returned func is called, which trims once more down to loopKeepStopped (the caller has
// removed its warm containers) and returns when that is done.
func (b *Backend) startLoopTrim() (stop func()) {
	quit, done := make(chan struct{}), make(chan struct{})
	go func() {
		defer close(done)
		t := time.NewTicker(loopTrimEvery)
		defer t.Stop()
		for keep := loopReserve; ; {
			n, err := blockdev.TrimFreeLoops(keep)
			switch {
			case err != nil:
				b.log.Warn("oci: free loop devices not trimmed", "err", err)
			case n > 0:
				b.log.Info("oci: removed free loop devices", "removed", n, "kept", keep)
			}
			if keep == loopKeepStopped {
				return
			}
			select {
			case <-quit:
				keep = loopKeepStopped
			case <-t.C:
			}
		}
	}()
	return func() {
		close(quit)
		<-done
	}
}
