package orchestrator

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/aenv-dev/aenv/internal/sandbox"
)

// Pause pauses a running sandbox. A pause already in flight is joined (its outcome is
// returned); an already paused sandbox is ErrConflict, as is one being killed.
// Operations in other transitional states are waited out.
func (o *Orchestrator) Pause(ctx context.Context, id string, opts sandbox.PauseOptions) error {
	e, joined, err := o.acquire(ctx, id, waitOpts{join: StatePausing, conflict: []State{StateKilling}})
	if err != nil {
		return err
	}
	if joined != nil {
		return joined.err
	}
	if e.rec.State == StatePaused {
		o.mu.Unlock()
		return fmt.Errorf("%w: sandbox %s is already paused", ErrConflict, id)
	}
	octx, cancel := o.opContext(ctx)
	defer cancel()
	return o.pauseLocked(octx, e, opts)
}

// pauseLocked pauses e, which must be stable and Running with o.mu held.
func (o *Orchestrator) pauseLocked(ctx context.Context, e *entry, opts sandbox.PauseOptions) error {
	p, _ := o.begin(e, StatePausing)
	start := time.Now()
	err := o.doPause(ctx, e, p, opts)
	o.m.observe(opPause, stageTotal, start, err)
	if err != nil {
		o.m.failures.WithLabelValues(opPause).Inc()
	}
	return err
}

func (o *Orchestrator) doPause(ctx context.Context, e *entry, p *op, opts sandbox.PauseOptions) error {
	o.mu.Lock()
	if e.timer != nil {
		e.timer.Stop()
		e.timer = nil
	}
	inst, id := e.inst, e.rec.ID
	o.mu.Unlock()
	if o.pausesToDisk(opts) {
		if handled, err := o.doDiskPause(ctx, e, p, inst); handled {
			return err
		}
	}

	var ps sandbox.PausedState
	err := o.m.timeStage(opPause, stagePause, func() (err error) {
		ps, err = inst.Pause(ctx, opts)
		return err
	})
	var raw []byte
	if err == nil {
		if raw, err = ps.Encode(); err != nil {
			// The backend paused but its state cannot be stored: undo the pause.
			err = fmt.Errorf("encode paused state: %w", err)
			o.mu.Lock()
			e.paused = ps
			o.mu.Unlock()
			return o.unpause(ctx, e, p, err)
		}
	}
	if err != nil {
		err = fmt.Errorf("pause sandbox %s: %w", id, err)
		if errors.Is(err, sandbox.ErrGone) {
			o.stopQuietly(ctx, inst)
			o.remove(e, p, err)
			o.m.kills.WithLabelValues("failure").Inc()
			return err
		}
		// Recoverable: the backend is running again, so is the sandbox.
		o.mu.Lock()
		o.armLocked(e)
		o.mu.Unlock()
		o.finish(e, p, StateRunning, err)
		return err
	}

	o.mu.Lock()
	e.paused = ps
	e.rec.Paused = raw
	e.rec.State = StatePaused // what persist stores; the op still guards the entry
	o.mu.Unlock()
	if err := o.m.timeStage(opPause, stagePersist, func() error { return o.persist(e) }); err != nil {
		o.mu.Lock()
		e.rec.State = StatePausing
		o.mu.Unlock()
		return o.unpause(ctx, e, p, err)
	}
	o.logEvent(e.rec.ID, LevelInfo, "sandbox paused", nil)
	o.finish(e, p, StatePaused, nil)
	// In a cluster, a paused state another node can restore: resumable there too.
	o.publishHandoff(ctx, e)
	return nil
}

// unpause rolls a pause back after the backend paused but the pause could not be
// recorded. cause is returned; if the sandbox cannot run again it is removed.
func (o *Orchestrator) unpause(ctx context.Context, e *entry, p *op, cause error) error {
	inst, version, err := o.revive(ctx, opPause, e)
	if err != nil {
		o.log.Error("roll back pause failed; removing sandbox", "sandbox", e.rec.ID, "err", err)
		o.discard(ctx, e)
		o.remove(e, p, cause)
		o.m.kills.WithLabelValues("failure").Inc()
		return cause
	}
	o.mu.Lock()
	e.inst, e.paused, e.rec.Paused, e.rec.EnvdVersion = inst, nil, nil, version
	o.armLocked(e)
	o.mu.Unlock()
	o.finish(e, p, StateRunning, cause)
	return cause
}

// revive brings a paused sandbox back: a sandbox paused to disk boots fresh processes
// on its captured filesystem; otherwise thaw in place when the instance survived the
// pause, or relaunch from its paused state. The id and tokens never change. On failure
// the paused state is untouched, so the sandbox can stay Paused.
func (o *Orchestrator) revive(ctx context.Context, operation string, e *entry) (sandbox.Instance, string, error) {
	c, err := o.diskSnapshot(operation, e)
	if err != nil {
		return nil, "", err
	}
	o.mu.Lock()
	inst, ps, rec := e.inst, e.paused, e.clone()
	o.mu.Unlock()
	if c != nil || inst == nil {
		// A new instance: a capture of the start command's output still running reads the
		// old one's dead stream and may not have noticed yet; left, it would keep
		// reattachStartCommand from attaching to the new one.
		o.logs.stopFollowingOf(rec.ID)
	}
	if c != nil {
		plan := sandbox.LaunchPlan{Kind: sandbox.LaunchFromSnapshot, SandboxID: rec.ID, RootFS: rec.Launch.RootFS,
			Resources: rec.Resources, AllowInternet: rec.AllowInternet, Snapshot: c, ColdBoot: true, Mounts: rec.Launch.Mounts}
		// Fresh processes: envd does not hold the token yet, so /init goes without it.
		return o.launch(ctx, operation, plan, rec, "")
	}
	if inst != nil {
		err := o.m.timeStage(operation, stageThaw, func() error { return inst.Resume(ctx) })
		if err == nil {
			return inst, rec.EnvdVersion, nil
		}
		if !errors.Is(err, sandbox.ErrGone) {
			return nil, "", fmt.Errorf("resume sandbox %s: %w", rec.ID, err)
		}
		// The backend's pause stopped the instance; resume goes through Launch.
		o.mu.Lock()
		e.inst = nil
		o.mu.Unlock()
		o.logs.stopFollowingOf(rec.ID)
	}
	err = o.m.timeStage(operation, stageDecode, func() (err error) {
		if ps == nil {
			ps, err = o.backend.DecodePaused(rec.Paused)
		}
		return err
	})
	if err != nil {
		return nil, "", fmt.Errorf("decode paused state of %s: %w", rec.ID, err)
	}
	o.mu.Lock()
	e.paused = ps
	o.mu.Unlock()
	plan := sandbox.LaunchPlan{Kind: sandbox.LaunchResume, SandboxID: rec.ID, RootFS: rec.Launch.RootFS,
		Resources: rec.Resources, AllowInternet: rec.AllowInternet, Paused: ps, Mounts: rec.Launch.Mounts}
	return o.launch(ctx, operation, plan, rec, rec.EnvdAccessToken)
}

// resumeLocked resumes e, which must be stable and Paused with o.mu held, with TTL
// now+timeout. cold asks for fresh processes on the paused filesystem (memory:false).
func (o *Orchestrator) resumeLocked(ctx context.Context, e *entry, timeout time.Duration, cold bool) (*Sandbox, error) {
	p, _ := o.begin(e, StateResuming)
	start := time.Now()
	sb, err := o.doResume(ctx, e, p, timeout, cold)
	o.m.observe(opResume, stageTotal, start, err)
	if err != nil {
		o.m.failures.WithLabelValues(opResume).Inc()
	}
	return sb, err
}

func (o *Orchestrator) doResume(ctx context.Context, e *entry, p *op, timeout time.Duration, cold bool) (*Sandbox, error) {
	if err := o.claimOwn(ctx, e); err != nil {
		if errors.Is(err, ErrMoved) {
			o.forget(ctx, e, p, err)
			return nil, err
		}
		o.finish(e, p, StatePaused, err)
		return nil, err
	}
	if cold {
		if err := o.toDisk(ctx, e); err != nil {
			o.finish(e, p, StatePaused, err)
			return nil, err
		}
	}
	inst, version, err := o.revive(ctx, opResume, e)
	if err != nil {
		o.finish(e, p, StatePaused, err)
		return nil, err
	}
	o.mu.Lock()
	disk, diskRaw, hid := e.disk, e.rec.DiskSnapshot, e.rec.Handoff
	e.inst, e.paused, e.rec.Paused, e.rec.EnvdVersion = inst, nil, nil, version
	e.disk, e.rec.DiskSnapshot, e.rec.Handoff = nil, nil, ""
	e.rec.EndAt = o.clock.Now().Add(timeout).UTC()
	o.mu.Unlock()
	if err := o.m.timeStage(opResume, stagePersist, func() error { return o.persist(e) }); err != nil {
		if disk != nil {
			// The disk snapshot is still what the catalog says: back to it.
			o.stopQuietly(ctx, inst)
			o.mu.Lock()
			e.inst, e.disk, e.rec.DiskSnapshot, e.rec.Handoff = nil, disk, diskRaw, hid
			o.mu.Unlock()
			o.finish(e, p, StatePaused, err)
			return nil, err
		}
		// Put it back to sleep so memory and disk agree again.
		ps, perr := inst.Pause(ctx, sandbox.PauseOptions{KeepMemory: true})
		var raw []byte
		if perr == nil {
			raw, perr = ps.Encode()
		}
		if perr != nil {
			o.log.Error("roll back resume failed; removing sandbox", "sandbox", e.rec.ID, "err", perr)
			o.stopQuietly(ctx, inst)
			o.discard(ctx, e)
			o.remove(e, p, err)
			o.m.kills.WithLabelValues("failure").Inc()
			return nil, err
		}
		o.mu.Lock()
		e.paused, e.rec.Paused = ps, raw
		o.mu.Unlock()
		o.finish(e, p, StatePaused, err)
		return nil, err
	}
	o.discardCapture(ctx, disk)
	// Claimed by this node above: no other node resumes it, and it is stale now.
	o.dropHandoff(ctx, hid)
	o.logEvent(e.rec.ID, LevelInfo, "sandbox resumed", map[string]string{"coldBoot": fmt.Sprint(cold || disk != nil)})
	o.reattachStartCommand(ctx, inst.Endpoint(), &e.rec) // paused in place by an earlier node
	o.mu.Lock()
	o.armLocked(e)
	o.mu.Unlock()
	return o.finish(e, p, StateRunning, nil), nil
}

// Connect is E2B's connect (v1 and v2) and resume: a running sandbox gets its TTL
// extended to at least now+timeout (never shortened) and resumed=false (HTTP 200); a
// paused one is resumed with TTL now+timeout and resumed=true (HTTP 201), keeping its
// id and tokens. A sandbox being killed is ErrConflict; unknown is ErrNotFound. A
// resume already in flight is joined.
func (o *Orchestrator) Connect(ctx context.Context, id string, opts ConnectOptions) (*Sandbox, bool, error) {
	timeout, err := o.validTimeout(opts.Timeout)
	if err != nil {
		return nil, false, err
	}
	resumed := false
	w := waitOpts{join: StateResuming, conflict: []State{StateKilling}}
	if opts.Adopt {
		// In a cluster a kill in flight may be this node forgetting a record that moved to
		// another node (reconcileHandoff): wait for it, then adopt, rather than 409.
		w.conflict = nil
	}
	for {
		e, joined, err := o.acquire(ctx, id, w)
		if errors.Is(err, ErrNotFound) && opts.Adopt {
			sb, err := o.adopt(ctx, id, timeout)
			return sb, err == nil, err
		}
		if err != nil {
			return nil, false, err
		}
		if joined != nil {
			if joined.err != nil {
				return nil, false, joined.err
			}
			resumed = true
			continue // extend the TTL of the now running sandbox
		}
		if e.rec.State == StatePaused {
			octx, cancel := o.opContext(ctx)
			sb, err := o.resumeLocked(octx, e, timeout, opts.ColdBoot)
			cancel()
			if errors.Is(err, ErrMoved) && opts.Adopt {
				// Our record was stale: it moved on from here, and may be paused again
				// elsewhere since.
				sb, err = o.adopt(ctx, id, timeout)
			}
			return sb, err == nil, err
		}
		end := o.clock.Now().Add(timeout).UTC()
		changed := end.After(e.rec.EndAt)
		if changed {
			e.rec.EndAt = end
			o.armLocked(e)
		}
		sb := e.clone()
		o.mu.Unlock()
		if changed {
			if err := o.persist(e); err != nil {
				return nil, false, err
			}
		}
		return sb, resumed, nil
	}
}

// Kill stops a sandbox and deletes its record; a paused sandbox's stored state is
// deleted too. A kill in flight is joined; other transitions are waited out. If the
// backend fails to stop it, the sandbox keeps its previous state and the error is
// returned.
func (o *Orchestrator) Kill(ctx context.Context, id string) error {
	e, joined, err := o.acquire(ctx, id, waitOpts{join: StateKilling})
	if err != nil {
		return err
	}
	if joined != nil {
		return joined.err
	}
	octx, cancel := o.opContext(ctx)
	defer cancel()
	return o.killLocked(octx, e, "api")
}

// killLocked kills e, which must be stable with o.mu held.
func (o *Orchestrator) killLocked(ctx context.Context, e *entry, reason string) error {
	m := o.metricsFor(e.rec.Metadata)
	p, prev := o.begin(e, StateKilling)
	start := time.Now()
	err := o.doKill(ctx, e, p, prev)
	m.observe(opKill, stageTotal, start, err)
	if err != nil {
		m.failures.WithLabelValues(opKill).Inc()
		return err
	}
	m.kills.WithLabelValues(reason).Inc()
	return nil
}

func (o *Orchestrator) doKill(ctx context.Context, e *entry, p *op, prev State) error {
	o.mu.Lock()
	if e.timer != nil {
		e.timer.Stop()
		e.timer = nil
	}
	inst, id, m := e.inst, e.rec.ID, o.metricsFor(e.rec.Metadata)
	o.mu.Unlock()
	if inst != nil {
		if err := m.timeStage(opKill, stageStop, func() error { return inst.Stop(ctx) }); err != nil {
			err = fmt.Errorf("stop sandbox %s: %w", id, err)
			if prev == StateRunning {
				o.mu.Lock()
				o.armLocked(e)
				o.mu.Unlock()
			}
			o.finish(e, p, prev, err)
			return err
		}
	}
	if prev == StatePaused {
		if err := o.claimOwn(ctx, e); errors.Is(err, ErrMoved) {
			// Resumed elsewhere: the kill is that node's to do.
			o.forget(ctx, e, p, err)
			return err
		}
		o.discard(ctx, e)
	}
	o.mu.Lock()
	handoffs := []string{e.rec.Handoff, e.rec.Launch.Adopted}
	o.mu.Unlock()
	start := time.Now()
	o.remove(e, p, nil)
	for _, h := range handoffs {
		if h != "" && !o.UsesTemplate(h) { // fork children share the parent's
			o.dropHandoff(ctx, h)
		}
	}
	m.observe(opKill, stagePersist, start, nil)
	return nil
}

// discard deletes a paused sandbox's stored state through the backend, when the
// backend keeps such state outside the instance. Failures are logged: the sandbox is
// going away regardless, and the backend's reconcile drops unknown state at startup.
func (o *Orchestrator) discard(ctx context.Context, e *entry) {
	if c, err := o.diskSnapshot(opKill, e); err != nil {
		o.log.Error("decode disk snapshot for discard", "sandbox", e.rec.ID, "err", err)
	} else if c != nil {
		o.discardCapture(ctx, c)
		return
	}
	d, ok := o.backend.(sandbox.PausedDiscarder)
	if !ok {
		return
	}
	o.mu.Lock()
	ps, raw, id := e.paused, e.rec.Paused, e.rec.ID
	o.mu.Unlock()
	if ps == nil {
		if len(raw) == 0 {
			return
		}
		var err error
		if ps, err = o.backend.DecodePaused(raw); err != nil {
			o.log.Error("decode paused state for discard", "sandbox", id, "err", err)
			return
		}
	}
	if err := d.DiscardPaused(ctx, id, ps); err != nil {
		o.log.Error("discard paused state", "sandbox", id, "err", err)
	}
}

// Endpoint is how the proxy reaches a sandbox. A running sandbox's endpoint is
// returned at once. A paused one is resumed transparently only when autoResume is true
// (the caller allows it) AND the sandbox was created with autoResume; its TTL is then
// at least the default timeout. Otherwise, and while it is being killed, the error is
// ErrNotRunning; unknown is ErrNotFound. EnvdPort is always filled in.
func (o *Orchestrator) Endpoint(ctx context.Context, id string, autoResume bool) (sandbox.Endpoint, *Sandbox, error) {
	for {
		e, joined, err := o.acquire(ctx, id, waitOpts{join: StateResuming, conflict: []State{StateKilling}})
		if errors.Is(err, ErrConflict) {
			return sandbox.Endpoint{}, nil, fmt.Errorf("%w: %s is being killed", ErrNotRunning, id)
		}
		if err != nil {
			return sandbox.Endpoint{}, nil, err
		}
		if joined != nil {
			if joined.err != nil {
				return sandbox.Endpoint{}, nil, fmt.Errorf("%w: resume of %s failed: %w", ErrNotRunning, id, joined.err)
			}
			continue
		}
		if e.rec.State == StatePaused {
			if !autoResume || !e.rec.AutoResume {
				o.mu.Unlock()
				return sandbox.Endpoint{}, nil, fmt.Errorf("%w: %s", ErrPaused, id)
			}
			octx, cancel := o.opContext(ctx)
			_, err := o.resumeLocked(octx, e, o.cfg.DefaultTimeout, false)
			cancel()
			if err != nil {
				return sandbox.Endpoint{}, nil, fmt.Errorf("%w: resume of %s failed: %w", ErrNotRunning, id, err)
			}
			continue
		}
		ep := e.inst.Endpoint()
		if ep.EnvdPort == 0 {
			ep.EnvdPort = o.cfg.EnvdPort
		}
		sb := e.clone()
		o.mu.Unlock()
		return ep, sb, nil
	}
}

// Metrics returns the sandbox's current resource counters: one sample while running,
// none while paused.
func (o *Orchestrator) Metrics(ctx context.Context, id string) ([]sandbox.Stats, error) {
	e, _, err := o.acquire(ctx, id, waitOpts{conflict: []State{StateKilling}})
	if err != nil {
		return nil, err
	}
	if e.rec.State == StatePaused || e.inst == nil {
		o.mu.Unlock()
		return []sandbox.Stats{}, nil
	}
	inst := e.inst
	o.mu.Unlock()
	st, err := inst.Stats(ctx)
	if errors.Is(err, sandbox.ErrGone) {
		// A pause or kill may have overtaken the read; report what the sandbox is now.
		o.mu.Lock()
		e := o.entries[id]
		changed := e == nil || e.inst != inst || e.rec.State != StateRunning
		o.mu.Unlock()
		if e == nil {
			return nil, fmt.Errorf("%w: %s", ErrNotFound, id)
		}
		if changed {
			return []sandbox.Stats{}, nil
		}
	}
	if err != nil {
		return nil, fmt.Errorf("stats of sandbox %s: %w", id, err)
	}
	if st.Timestamp.IsZero() {
		st.Timestamp = o.clock.Now().UTC()
	}
	return []sandbox.Stats{st}, nil
}

// DropLost removes sandboxes the backend has lost (their root disk's server died, why
// says so): each is stopped (what is left of it is released) and forgotten, with an
// error in the node's log and in aenv_sandbox_kills_total{reason="lost"}. A sandbox
// busy in another operation is handled once that ends.
func (o *Orchestrator) DropLost(ctx context.Context, ids []string, why string) {
	for _, id := range ids {
		e, _, err := o.acquire(ctx, id, waitOpts{})
		if err != nil {
			continue
		}
		o.log.Error("sandbox lost; removing it", "sandbox", id, "state", e.rec.State, "why", why)
		if err := o.killLocked(ctx, e, "lost"); err != nil {
			o.log.Error("remove a lost sandbox", "sandbox", id, "err", err)
		}
	}
}
