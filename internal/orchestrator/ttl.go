package orchestrator

import (
	"context"
	"fmt"
	"time"

	"github.com/aenv-dev/aenv/internal/sandbox"
)

// Clock is the time source of TTLs. Tests inject a fake one that fires timers when
// advanced; durations in metrics always use the wall clock.
type Clock interface {
	Now() time.Time
	// AfterFunc calls f in its own goroutine (or synchronously, for a fake clock) once d
	// has elapsed.
	AfterFunc(d time.Duration, f func()) Stopper
}

// Stopper cancels a pending AfterFunc.
type Stopper interface{ Stop() bool }

type realClock struct{}

func (realClock) Now() time.Time                              { return time.Now() }
func (realClock) AfterFunc(d time.Duration, f func()) Stopper { return time.AfterFunc(d, f) }

// armLocked (re)schedules expiry at e.rec.EndAt; o.mu must be held. Paused sandboxes
// never expire, so they are not armed.
func (o *Orchestrator) armLocked(e *entry) {
	if e.timer != nil {
		e.timer.Stop()
		e.timer = nil
	}
	if o.closing || e.gone || e.rec.State == StatePaused {
		return
	}
	id := e.rec.ID
	d := e.rec.EndAt.Sub(o.clock.Now())
	e.timer = o.clock.AfterFunc(max(d, 0), func() {
		o.mu.Lock()
		if o.closing {
			o.mu.Unlock()
			return
		}
		o.bg.Add(1)
		o.mu.Unlock()
		go func() {
			defer o.bg.Done()
			o.expire(id)
		}()
	})
}

// expire kills or pauses a sandbox whose TTL elapsed. A stale timer (the TTL was
// extended after it was set) finds EndAt in the future and does nothing.
func (o *Orchestrator) expire(id string) {
	ctx, cancel := o.opContext(context.Background())
	defer cancel()
	e, _, err := o.acquire(ctx, id, waitOpts{})
	if err != nil {
		return
	}
	if e.rec.State != StateRunning || o.closing {
		o.mu.Unlock()
		return
	}
	if o.clock.Now().Before(e.rec.EndAt) {
		o.armLocked(e)
		o.mu.Unlock()
		return
	}
	if e.rec.AutoPause {
		o.log.Info("sandbox timeout: pausing", "sandbox", id)
		err = o.pauseLocked(ctx, e, sandbox.PauseOptions{KeepMemory: !e.rec.AutoPauseDisk})
	} else {
		o.log.Info("sandbox timeout: killing", "sandbox", id)
		err = o.killLocked(ctx, e, "timeout")
	}
	if err != nil {
		o.log.Error("sandbox timeout action failed", "sandbox", id, "autoPause", e.rec.AutoPause, "err", err)
	}
}

// SetTimeout sets the sandbox's TTL to now+d, shortening or extending it; d <= 0
// expires it now (the expiry runs asynchronously, as E2B does). A paused sandbox has
// no TTL: ErrConflict.
func (o *Orchestrator) SetTimeout(ctx context.Context, id string, d time.Duration) error {
	if d > o.cfg.MaxTimeout {
		return fmt.Errorf("%w: timeout %s exceeds the maximum of %s", ErrInvalid, d, o.cfg.MaxTimeout)
	}
	return o.updateTTL(ctx, id, max(d, 0), false)
}

// Refresh extends the TTL to now+d if that is later than the current expiry; it
// never shortens. d <= 0 means the default timeout.
func (o *Orchestrator) Refresh(ctx context.Context, id string, d time.Duration) error {
	d, err := o.validTimeout(max(d, 0))
	if err != nil {
		return err
	}
	return o.updateTTL(ctx, id, d, true)
}

func (o *Orchestrator) updateTTL(ctx context.Context, id string, d time.Duration, extendOnly bool) error {
	e, _, err := o.acquire(ctx, id, waitOpts{conflict: []State{StateKilling}})
	if err != nil {
		return err
	}
	if e.rec.State == StatePaused {
		o.mu.Unlock()
		return pausedConflict(id)
	}
	end := o.clock.Now().Add(d)
	if extendOnly && !end.After(e.rec.EndAt) {
		o.mu.Unlock()
		return nil
	}
	e.rec.EndAt = end
	o.armLocked(e)
	o.mu.Unlock()
	return o.persist(e)
}

func pausedConflict(id string) error {
	return fmt.Errorf("%w: sandbox %s is paused", ErrConflict, id)
}
