package orchestrator

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"sync"
	"time"

	"github.com/aenv-dev/aenv/internal/sandbox"
)

// Start loads the persisted records and reconciles them with what the backend still
// has. The backend removes every instance and artefact it finds that no record knows
// (containers, mounts, netns left by a crash). Then:
//   - a running record whose instance survived is adopted and its TTL re-armed (an
//     already elapsed TTL expires at once);
//   - a running record without an instance died with the node: its record is deleted;
//   - a paused record is kept with its instance if the backend still has one (pause in
//     place), else if the backend can decode its paused state; otherwise deleted;
//   - a record paused to disk is kept if the backend can decode its disk snapshot (an
//     instance that survived is stopped: the node died mid-pause or mid-resume).
//
// Then the backend frees the captures nothing references any more (CaptureReconciler)
// and snapshots registered but never handed to the publisher are published: both are
// what a node killed in the middle of a snapshot, fork or pause to disk leaves.
//
// Start must be called once, before the orchestrator serves requests.
func (o *Orchestrator) Start(ctx context.Context) error {
	o.mu.Lock()
	if len(o.entries) > 0 || o.closing {
		o.mu.Unlock()
		return errors.New("orchestrator: Start called twice or after Shutdown")
	}
	o.mu.Unlock()

	all, err := o.records.All()
	if err != nil {
		return fmt.Errorf("orchestrator start: %w", err)
	}
	recs := map[string]*Sandbox{}
	for id, raw := range all {
		rec, err := decodeRecord(raw)
		if err != nil || rec.ID != id {
			o.log.Error("dropping unreadable sandbox record", "sandbox", id, "err", err)
			o.dropRecord(id)
			continue
		}
		recs[id] = rec
	}
	ids := slices.Sorted(func(yield func(string) bool) {
		for id := range recs {
			if !yield(id) {
				return
			}
		}
	})
	began := time.Now()
	alive, err := o.backend.Reconcile(ctx, ids)
	if err != nil {
		return fmt.Errorf("orchestrator start: reconcile backend: %w", err)
	}
	reconciled := time.Now()

	kept, dropped := 0, 0
	for _, id := range ids {
		rec, inst := recs[id], alive[id]
		e := &entry{rec: *rec, inst: inst}
		if rec.State == StatePaused && len(rec.DiskSnapshot) > 0 {
			c, err := o.backend.DecodeCaptured(rec.DiskSnapshot)
			if err != nil {
				o.log.Warn("dropping paused sandbox whose disk snapshot the backend cannot use", "sandbox", id, "err", err)
				if inst != nil {
					o.stopQuietly(ctx, inst)
				}
				o.dropRecord(id)
				dropped++
				continue
			}
			if inst != nil {
				// The node died between recording the pause (or before recording a
				// resume) and the instance's stop: the record is the truth.
				o.stopQuietly(ctx, inst)
				e.inst = nil
			}
			e.disk = c
		} else if rec.State == StatePaused {
			if inst == nil && !o.backend.Capabilities().PauseReleasesMemory {
				// The paused state lived in the instance (a frozen container): without
				// it there is nothing to resume, and keeping the record would only make
				// every later connect fail.
				o.log.Warn("dropping paused sandbox whose instance did not survive the restart", "sandbox", id)
				o.dropRecord(id)
				dropped++
				continue
			}
			if inst == nil {
				ps, err := o.backend.DecodePaused(rec.Paused)
				if err != nil {
					o.log.Warn("dropping paused sandbox whose state the backend cannot use", "sandbox", id, "err", err)
					o.dropRecord(id)
					dropped++
					continue
				}
				e.paused = ps
			}
		} else {
			if inst == nil {
				o.log.Warn("dropping sandbox that did not survive the restart", "sandbox", id)
				o.dropRecord(id)
				dropped++
				continue
			}
			e.rec.State = StateRunning
			o.reattachStartCommand(ctx, inst.Endpoint(), &e.rec)
		}
		o.reapplyEgress(ctx, e)
		o.mu.Lock()
		o.entries[id] = e
		o.armLocked(e)
		o.mu.Unlock()
		kept++
	}
	adopted := time.Now()
	o.reconcilePins()
	o.sweepLogs()
	o.reconcileCaptures(ctx)
	o.publishMissed(ctx)
	o.log.Info("orchestrator started", "sandboxes", kept, "dropped", dropped,
		"reconcile", reconciled.Sub(began), "adopt", adopted.Sub(reconciled), "captures", time.Since(adopted))
	return nil
}

func (o *Orchestrator) dropRecord(id string) {
	if err := o.records.Delete(id); err != nil {
		o.log.Error("delete sandbox record", "sandbox", id, "err", err)
	}
}

// shutdownParallelism bounds concurrent pauses or stops during Shutdown.
const shutdownParallelism = 8

// Shutdown stops accepting creates and TTL expiries, waits for operations in flight,
// then applies Config.ShutdownAction to every running sandbox: pause (resumable after
// the restart), stop (killed and forgotten) or keep (left running for Start to adopt).
// It returns when done or when ctx ends, joining the errors of sandboxes it could not
// handle. The catalog stays open; the caller closes it afterwards.
func (o *Orchestrator) Shutdown(ctx context.Context) error {
	o.mu.Lock()
	if o.closing {
		o.mu.Unlock()
		return nil
	}
	o.closing = true
	ids := make([]string, 0, len(o.entries))
	for id, e := range o.entries {
		ids = append(ids, id)
		if e.timer != nil {
			e.timer.Stop()
			e.timer = nil
		}
	}
	o.mu.Unlock()

	// Expiries already running finish first so they do not race the shutdown action.
	if err := waitGroup(ctx, &o.bg); err != nil {
		return fmt.Errorf("orchestrator shutdown: %w", err)
	}

	var (
		mu   sync.Mutex
		errs []error
		wg   sync.WaitGroup
		sem  = make(chan struct{}, shutdownParallelism)
	)
	for _, id := range ids {
		wg.Add(1)
		sem <- struct{}{}
		go func() {
			defer func() { <-sem; wg.Done() }()
			if err := o.shutdownOne(ctx, id); err != nil {
				mu.Lock()
				errs = append(errs, err)
				mu.Unlock()
			}
		}()
	}
	wg.Wait()
	// Kept sandboxes' start commands run on; the next node re-attaches to their output.
	if err := o.logs.stopFollowing(ctx); err != nil {
		errs = append(errs, err)
	}
	if err := errors.Join(errs...); err != nil {
		return fmt.Errorf("orchestrator shutdown: %w", err)
	}
	return nil
}

func (o *Orchestrator) shutdownOne(ctx context.Context, id string) error {
	e, _, err := o.acquire(ctx, id, waitOpts{})
	if errors.Is(err, ErrNotFound) {
		return nil
	}
	if err != nil {
		return fmt.Errorf("sandbox %s: %w", id, err)
	}
	if e.rec.State != StateRunning || o.cfg.ShutdownAction == ShutdownKeep {
		o.mu.Unlock()
		return nil
	}
	if o.cfg.ShutdownAction == ShutdownStop {
		return o.killLocked(ctx, e, "shutdown")
	}
	// A container's in-place pause lives in the node (its block root is served by this
	// process), so it would not survive the restart: without memory snapshots, pause to
	// disk, which falls back to pausing in place where the sandbox cannot be captured.
	return o.pauseLocked(ctx, e, sandbox.PauseOptions{KeepMemory: o.backend.Capabilities().MemorySnapshots})
}

// waitGroup waits for wg until ctx is done; ctx's error then (the waiting goroutine stays
// until wg is done).
func waitGroup(ctx context.Context, wg *sync.WaitGroup) error {
	done := make(chan struct{})
	go func() { wg.Wait(); close(done) }()
	select {
	case <-done:
		return nil
	case <-ctx.Done():
		return ctx.Err()
	}
}
