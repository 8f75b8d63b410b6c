package node

import (
	"context"
	"fmt"
	"log/slog"
	"sync"
	"time"
)

// baseBuild runs the node's own build of the base template (debootstrap, minutes) in the
// background, logs its progress, and meanwhile tells the orchestrator why base is not in
// the catalog yet, so a create from it answers 503 with the reason instead of 404.
type baseBuild struct {
	log *slog.Logger
	// progressEvery is how often a running build logs its latest step at info level.
	progressEvery time.Duration

	mu      sync.Mutex
	running bool
	started time.Time
	last    string // debootstrap's latest progress line
	err     error  // the failed build's error; nil while running or after success
	cancel  context.CancelFunc
	done    chan struct{}
}

func newBaseBuild(log *slog.Logger) *baseBuild {
	return &baseBuild{log: log, progressEvery: 15 * time.Second}
}

// start runs build in the background, detached from any request; stop cancels it.
func (b *baseBuild) start(build func(ctx context.Context, progress func(string)) error) {
	ctx, cancel := context.WithCancel(context.Background())
	b.mu.Lock()
	b.running, b.started, b.err, b.cancel, b.done = true, time.Now(), nil, cancel, make(chan struct{})
	done := b.done
	b.mu.Unlock()

	go func() {
		defer close(done)
		tick := time.NewTicker(b.progressEvery)
		defer tick.Stop()
		stopTick := make(chan struct{})
		go func() {
			for {
				select {
				case <-tick.C:
					b.mu.Lock()
					last, el := b.last, time.Since(b.started).Round(time.Second)
					b.mu.Unlock()
					b.log.Info("base template build in progress", "elapsed", el, "step", last)
				case <-stopTick:
					return
				}
			}
		}()
		err := build(ctx, func(line string) {
			b.log.Debug("base template build", "debootstrap", line)
			b.mu.Lock()
			b.last = line
			b.mu.Unlock()
		})
		close(stopTick)
		b.mu.Lock()
		b.running, b.err = false, err
		el := time.Since(b.started).Round(time.Second)
		b.mu.Unlock()
		if err != nil {
			b.log.Error("the base template could not be built; creates from it answer 503 until the node restarts", "err", err)
			return
		}
		b.log.Info("base template built", "elapsed", el)
	}()
}

// pending answers the orchestrator for a template id the catalog lacks: why base is not
// there yet, or nil (not base, or no build of it on this node).
func (b *baseBuild) pending(id string) error {
	if id != BaseTemplateID {
		return nil
	}
	b.mu.Lock()
	defer b.mu.Unlock()
	switch {
	case b.running:
		step := ""
		if b.last != "" {
			step = ", at " + b.last
		}
		return fmt.Errorf("template %q is being built on this node with debootstrap (started %s ago%s); retry in a minute or two, or create from %q meanwhile",
			id, time.Since(b.started).Round(time.Second), step, MinimalTemplateID)
	case b.err != nil:
		return fmt.Errorf("template %q could not be built on this node: %w", id, b.err)
	}
	return nil
}

// stop cancels a running build and waits for it to clean up (debootstrap's mounts, its
// temporary tree).
func (b *baseBuild) stop() {
	b.mu.Lock()
	cancel, done := b.cancel, b.done
	b.mu.Unlock()
	if cancel == nil {
		return
	}
	cancel()
	<-done
}
