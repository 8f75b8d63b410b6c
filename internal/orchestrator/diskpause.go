package orchestrator

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"

	"github.com/aenv-dev/aenv/internal/sandbox"
)

// pausesToDisk says whether a pause with opts is a pause to disk: a snapshot of the
// filesystem, then the instance is stopped and releases everything it held. That is
// E2B's memory:false, and every pause on a backend that cannot keep processes across a
// pause. A backend that cannot snapshot pauses in place instead (keeping more than
// asked: the filesystem survives either way).
func (o *Orchestrator) pausesToDisk(opts sandbox.PauseOptions) bool {
	caps := o.backend.Capabilities()
	return caps.Snapshots && (!opts.KeepMemory || !caps.PauseKeepsProcesses)
}

// doDiskPause pauses e to disk during transition p. The capture is recorded before the
// instance is stopped, so a crash in between leaves a paused record (and Start stops
// the instance that survived it) rather than a running record without an instance.
// handled is false, with the transition still open, when the backend cannot capture
// this sandbox (ErrUnsupported): the caller pauses it in place instead.
func (o *Orchestrator) doDiskPause(ctx context.Context, e *entry, p *op, inst sandbox.Instance) (handled bool, _ error) {
	c, raw, err := o.captureInstance(ctx, opPause, e)
	if errors.Is(err, ErrUnsupported) && !errors.Is(err, sandbox.ErrGone) {
		o.log.Debug("pause to disk unsupported for this sandbox; pausing in place", "sandbox", e.rec.ID, "err", err)
		return false, nil
	}
	if err != nil {
		return true, o.captureFailed(ctx, e, p, err)
	}
	o.crashPoint(opPause, stageCapture)
	o.mu.Lock()
	e.disk, e.rec.DiskSnapshot = c, json.RawMessage(raw)
	e.rec.State = StatePaused // what persist stores; the op still guards the entry
	o.mu.Unlock()
	if err := o.m.timeStage(opPause, stagePersist, func() error { return o.persist(e) }); err != nil {
		return true, o.keepRunning(ctx, e, p, c, err)
	}
	o.crashPoint(opPause, stagePersist)
	if err := o.m.timeStage(opPause, stageStop, func() error { return stopCaptured(ctx, inst) }); err != nil {
		err = fmt.Errorf("stop sandbox %s after its disk snapshot: %w", e.rec.ID, err)
		if perr := o.persist(o.clearDisk(e)); perr != nil {
			o.log.Error("record pause rollback", "sandbox", e.rec.ID, "err", perr)
		}
		return true, o.keepRunning(ctx, e, p, c, err)
	}
	o.mu.Lock()
	e.inst, e.paused, e.rec.Paused = nil, nil, nil
	o.mu.Unlock()
	o.finish(e, p, StatePaused, nil)
	// In a cluster: resumable on another node once this returns.
	o.publishHandoff(ctx, e)
	return true, nil
}

// stopCaptured stops inst after a pause to disk captured it.
func stopCaptured(ctx context.Context, inst sandbox.Instance) error {
	if s, ok := inst.(sandbox.CapturedStopper); ok {
		return s.StopAfterCapture(ctx)
	}
	return inst.Stop(ctx)
}

// clearDisk forgets e's disk snapshot and marks it running again (for persist).
func (o *Orchestrator) clearDisk(e *entry) *entry {
	o.mu.Lock()
	e.disk, e.rec.DiskSnapshot = nil, nil
	e.rec.State = StatePausing
	o.mu.Unlock()
	return e
}

// keepRunning rolls a pause to disk back while the instance still runs.
func (o *Orchestrator) keepRunning(ctx context.Context, e *entry, p *op, c sandbox.Captured, cause error) error {
	o.clearDisk(e)
	o.discardCapture(ctx, c)
	o.mu.Lock()
	o.armLocked(e)
	o.mu.Unlock()
	o.finish(e, p, StateRunning, cause)
	return cause
}

// diskSnapshot returns e's disk snapshot, decoding the stored one if needed; nil when
// the sandbox is not paused to disk.
func (o *Orchestrator) diskSnapshot(operation string, e *entry) (sandbox.Captured, error) {
	o.mu.Lock()
	c, raw, id := e.disk, e.rec.DiskSnapshot, e.rec.ID
	o.mu.Unlock()
	if c == nil && len(raw) == 0 {
		return nil, nil
	}
	if c != nil && operation != opResume {
		return c, nil
	}
	// A resume from disk always has its decode stage (docs/operations.md), even when
	// the capture is still decoded from the pause.
	err := o.m.timeStage(operation, stageDecode, func() (err error) {
		if c == nil {
			c, err = o.backend.DecodeCaptured(raw)
		}
		return err
	})
	if err != nil {
		return nil, fmt.Errorf("decode disk snapshot of %s: %w", id, err)
	}
	o.mu.Lock()
	e.disk = c
	o.mu.Unlock()
	return c, nil
}

// toDisk turns a sandbox paused in memory with a live (frozen) instance into one
// paused to disk, for a cold-boot connect (memory:false). It is a no-op when the
// sandbox is already on disk, the backend cannot snapshot (it), or no instance is left
// (a memory image without an instance is then restored as is). On failure the sandbox is
// still paused as before.
func (o *Orchestrator) toDisk(ctx context.Context, e *entry) error {
	o.mu.Lock()
	inst, onDisk := e.inst, e.disk != nil || len(e.rec.DiskSnapshot) > 0
	o.mu.Unlock()
	if onDisk || inst == nil || !o.backend.Capabilities().Snapshots {
		return nil
	}
	var c sandbox.Captured
	err := o.m.timeStage(opResume, stageCapture, func() (err error) {
		c, err = inst.Snapshot(ctx)
		return err
	})
	var raw []byte
	if err == nil {
		raw, err = c.Encode()
		if err == nil && !json.Valid(raw) {
			err = errors.New("backend encoded its capture as something other than JSON")
		}
		if err != nil {
			o.discardCapture(ctx, c)
		}
	}
	if errors.Is(err, sandbox.ErrUnsupported) {
		// This sandbox cannot be captured: it resumes with its processes instead.
		return nil
	}
	if errors.Is(err, sandbox.ErrGone) {
		// The backend's pause stopped the instance (a memory image): restore that.
		o.mu.Lock()
		e.inst = nil
		o.mu.Unlock()
		return nil
	}
	if err != nil {
		return fmt.Errorf("cold boot of %s: snapshot: %w", e.rec.ID, err)
	}
	if err := inst.Stop(ctx); err != nil {
		o.discardCapture(ctx, c)
		return fmt.Errorf("cold boot of %s: stop: %w", e.rec.ID, err)
	}
	o.mu.Lock()
	prevPaused := e.paused
	e.inst, e.paused, e.rec.Paused = nil, nil, nil
	e.disk, e.rec.DiskSnapshot = c, json.RawMessage(raw)
	st := e.rec.State
	e.rec.State = StatePaused
	o.mu.Unlock()
	err = o.persist(e)
	o.mu.Lock()
	e.rec.State = st
	o.mu.Unlock()
	if err != nil {
		// Memory is now right and disk is stale; the resume that follows persists again.
		o.log.Error("record cold-boot conversion", "sandbox", e.rec.ID, "err", err)
	}
	if d, ok := o.backend.(sandbox.PausedDiscarder); ok && prevPaused != nil {
		if err := d.DiscardPaused(ctx, e.rec.ID, prevPaused); err != nil {
			o.log.Error("discard paused state", "sandbox", e.rec.ID, "err", err)
		}
	}
	return nil
}
