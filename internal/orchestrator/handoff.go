package orchestrator

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"maps"
	"time"

	"github.com/aenv-dev/aenv/internal/catalog"
	"github.com/aenv-dev/aenv/internal/repository"
	"github.com/aenv-dev/aenv/internal/sandbox"
	"github.com/aenv-dev/aenv/internal/snapshot"
)

// Handoffs publish sandboxes paused to disk so that another node of the cluster can
// resume them, and claim them so that exactly one node ever does (*snapshot.Publisher;
// see snapshot/handoff.go for the record and the claim).
type Handoffs interface {
	PublishHandoff(ctx context.Context, t catalog.Template, envdVersion string, sandbox json.RawMessage) (*snapshot.Handle, error)
	ClaimHandoff(ctx context.Context, sandboxID, owner string) (catalog.Template, json.RawMessage, error)
	ClaimOwnHandoff(ctx context.Context, id, owner string) error
	ReleaseHandoff(ctx context.Context, id, owner string) error
	HandoffClaimedElsewhere(ctx context.Context, id, owner string) (bool, error)
	Delete(ctx context.Context, id string) (repository.GCResult, error)
}

// handoff is the cluster side of an orchestrator (nil on a lone node).
type handoff struct {
	h    Handoffs
	node string
}

// handoffPublishTimeout bounds the wait of a pause to disk for its publication.
const handoffPublishTimeout = 10 * time.Minute

// EnableHandoff makes every pause to disk publish the sandbox through h (the pause
// returns once it is published), so that nodes of the cluster other than node can resume
// it, and makes a resume here claim it first. Call it before serving requests.
func (o *Orchestrator) EnableHandoff(h Handoffs, node string) {
	o.handoff.Store(&handoff{h: h, node: node})
}

// publishHandoff publishes e, just paused to disk (or paused with its memory by a
// backend whose paused state is a capture: sandbox.PausedCapturer), and records the
// handoff's id once it is complete. A failure is logged: the sandbox stays paused and
// resumable on this node.
func (o *Orchestrator) publishHandoff(ctx context.Context, e *entry) {
	hf := o.handoff.Load()
	if hf == nil {
		return
	}
	o.mu.Lock()
	rec := e.clone()
	ps := e.paused
	o.mu.Unlock()
	if rec.State != StatePaused || len(rec.VolumeMounts) > 0 {
		return // volumes are node-local: such a sandbox resumes here only
	}
	artifact := rec.DiskSnapshot
	if len(artifact) == 0 {
		artifact = o.portablePause(rec.ID, ps)
	}
	if len(artifact) == 0 {
		return
	}
	now := o.clock.Now()
	hid := snapshot.HandoffID(rec.ID, now)
	tpl := snapshotTemplate(rec, hid, "", artifact, now)
	sbRec := *rec
	// DiskSnapshot stays in the record of a pause to disk: the node that adopts it boots
	// fresh processes, as this one would (E2B's memory:false), even from a capture that
	// holds memory.
	sbRec.Paused, sbRec.Handoff = nil, ""
	raw, err := encodeRecord(&sbRec)
	if err == nil {
		ctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), handoffPublishTimeout)
		defer cancel()
		err = o.metricsFor(rec.Metadata).timeStage(opPause, stageHandoff, func() error {
			hd, err := hf.h.PublishHandoff(ctx, tpl, rec.EnvdVersion, raw)
			if err == nil && hd != nil {
				err = hd.Wait(ctx)
			}
			return err
		})
	}
	if err != nil {
		o.log.Error("publish the paused sandbox for other nodes; it resumes on this node only", "sandbox", rec.ID, "err", err)
		o.dropHandoff(ctx, hid)
		return
	}
	o.mu.Lock()
	same := !e.gone && e.op == nil && e.rec.State == StatePaused &&
		string(e.rec.DiskSnapshot) == string(rec.DiskSnapshot) && string(e.rec.Paused) == string(rec.Paused)
	if same {
		e.rec.Handoff = hid
	}
	o.mu.Unlock()
	if !same {
		// Resumed or killed meanwhile: the handoff describes nothing any more.
		o.dropHandoff(ctx, hid)
		return
	}
	if err := o.persist(e); err != nil {
		o.log.Error("record the handoff of a paused sandbox", "sandbox", rec.ID, "err", err)
	}
	o.logEvent(rec.ID, LevelInfo, "sandbox published for resume on any node", map[string]string{"handoff": hid})
}

// portablePause returns the artifact of paused state ps when the backend can resume it
// on another node (sandbox.PausedCapturer), else nil.
func (o *Orchestrator) portablePause(id string, ps sandbox.PausedState) json.RawMessage {
	pc, ok := o.backend.(sandbox.PausedCapturer)
	if !ok || ps == nil {
		return nil
	}
	c, ok := pc.PausedCapture(ps)
	if !ok {
		return nil
	}
	raw, err := c.Encode()
	if err != nil || !json.Valid(raw) {
		o.log.Error("encode a paused sandbox for other nodes; it resumes on this node only", "sandbox", id, "err", err)
		return nil
	}
	return raw
}

// dropHandoff deletes handoff id from the repository (best effort).
func (o *Orchestrator) dropHandoff(ctx context.Context, id string) {
	hf := o.handoff.Load()
	if hf == nil || id == "" {
		return
	}
	if _, err := hf.h.Delete(context.WithoutCancel(ctx), id); err != nil && !errors.Is(err, snapshot.ErrNotFound) {
		o.log.Warn("delete a handoff from the repository", "handoff", id, "err", err)
	}
}

// claimOwn claims e's handoff before this node resumes it. ErrMoved: another node
// claimed it; the caller forgets the sandbox.
func (o *Orchestrator) claimOwn(ctx context.Context, e *entry) error {
	hf := o.handoff.Load()
	o.mu.Lock()
	hid := e.rec.Handoff
	o.mu.Unlock()
	if hf == nil || hid == "" {
		return nil
	}
	err := hf.h.ClaimOwnHandoff(ctx, hid, hf.node)
	if errors.Is(err, snapshot.ErrClaimed) {
		return fmt.Errorf("%w: %w", ErrMoved, err)
	}
	if err != nil {
		return fmt.Errorf("claim the published pause of %s: %w", e.rec.ID, err)
	}
	return nil
}

// forget removes a paused sandbox that another node resumed: its local state goes, its
// handoffs stay for the node that runs it now. p is the transition the caller holds.
func (o *Orchestrator) forget(ctx context.Context, e *entry, p *op, cause error) {
	o.mu.Lock()
	adopted := e.rec.Launch.Adopted
	o.mu.Unlock()
	o.discard(ctx, e)
	o.remove(e, p, cause)
	// The handoff it was resumed from here: the newer one names every blob it did.
	if adopted != "" && !o.UsesTemplate(adopted) {
		o.dropHandoff(ctx, adopted)
	}
	o.log.Info("paused sandbox resumed by another node; forgotten here", "sandbox", e.rec.ID, "err", cause)
}

// adopt resumes sandbox id, unknown here, from its newest handoff (it was paused to
// disk on another node), keeping its id, tokens, metadata and environment. The resume
// is a launch from the handoff's capture, as a create from a snapshot: files always,
// processes and memory where the backend's snapshots keep them.
func (o *Orchestrator) adopt(ctx context.Context, id string, timeout time.Duration) (*Sandbox, error) {
	hf := o.handoff.Load()
	if hf == nil {
		return nil, fmt.Errorf("%w: %s", ErrNotFound, id)
	}
	start := time.Now()
	sb, err := o.adoptClaimed(ctx, hf, id, timeout)
	if !errors.Is(err, ErrNotFound) {
		o.m.observe(opResume, stageTotal, start, err)
	}
	if err != nil && !clientError(err) {
		o.m.failures.WithLabelValues(opResume).Inc()
	}
	return sb, err
}

func (o *Orchestrator) adoptClaimed(ctx context.Context, hf *handoff, id string, timeout time.Duration) (*Sandbox, error) {
	var tpl catalog.Template
	var raw json.RawMessage
	err := o.m.timeStage(opResume, stageClaim, func() (err error) {
		tpl, raw, err = hf.h.ClaimHandoff(ctx, id, hf.node)
		return err
	})
	switch {
	case errors.Is(err, snapshot.ErrNotFound):
		return nil, fmt.Errorf("%w: %s (not here, and not paused on another node)", ErrNotFound, id)
	case errors.Is(err, snapshot.ErrClaimed):
		return nil, fmt.Errorf("%w: sandbox %s: %w", ErrConflict, id, err)
	case err != nil:
		return nil, fmt.Errorf("adopt sandbox %s: %w", id, err)
	}
	sb, err := o.adoptFrom(ctx, id, tpl, raw, timeout)
	if err != nil {
		if rerr := hf.h.ReleaseHandoff(context.WithoutCancel(ctx), tpl.ID, hf.node); rerr != nil {
			o.log.Error("release a handoff after a failed adoption", "handoff", tpl.ID, "err", rerr)
		}
		return nil, err
	}
	o.logEvent(id, LevelInfo, "sandbox resumed from another node's pause", map[string]string{"handoff": tpl.ID})
	return sb, nil
}

func (o *Orchestrator) adoptFrom(ctx context.Context, id string, tpl catalog.Template, raw json.RawMessage, timeout time.Duration) (*Sandbox, error) {
	var rec Sandbox
	if err := json.Unmarshal(raw, &rec); err != nil || rec.ID != id {
		return nil, fmt.Errorf("%w: handoff %s does not hold sandbox %s's record", ErrInvalid, tpl.ID, id)
	}
	if len(rec.VolumeMounts) > 0 {
		return nil, fmt.Errorf("%w: sandbox %s mounts node-local volumes", ErrInvalid, id)
	}
	c, err := o.decodeSnapshotTemplate(opResume, tpl)
	if err != nil {
		return nil, err
	}
	startedAt := rec.StartedAt
	cold := len(rec.DiskSnapshot) > 0 // paused to disk (memory:false): fresh processes
	rec.Paused, rec.DiskSnapshot, rec.Handoff, rec.EnvdVersion = nil, nil, "", ""
	rec.Metadata, rec.EnvVars = maps.Clone(rec.Metadata), maps.Clone(rec.EnvVars)
	rec.Launch.RootFS = sandbox.RootFS{LowerDir: o.directory(tpl.RootFSDir)}
	rec.Launch.Mounts = nil
	rec.Launch.Adopted = tpl.ID
	if err := o.cfg.Capacity.Check(rec.Resources); err != nil {
		return nil, fmt.Errorf("%w: %w", ErrInvalid, err)
	}
	plan := sandbox.LaunchPlan{Kind: sandbox.LaunchFromSnapshot, SandboxID: id, RootFS: rec.Launch.RootFS,
		Resources: rec.Resources, AllowInternet: rec.AllowInternet, Snapshot: c, ColdBoot: cold}
	sb, err := o.start(ctx, opResume, rec, plan, timeout, tpl.EnvdAccessToken)
	if err != nil {
		return nil, err
	}
	o.mu.Lock()
	if e := o.entries[id]; e != nil && !startedAt.IsZero() {
		e.rec.StartedAt = startedAt
		sb.StartedAt = startedAt
	}
	o.mu.Unlock()
	return sb, nil
}

// ReconcileHandoffs forgets the sandboxes paused here that another node has resumed
// since (this node was stale, full or draining when a client resumed them). The node
// calls it at start and periodically.
func (o *Orchestrator) ReconcileHandoffs(ctx context.Context) {
	hf := o.handoff.Load()
	if hf == nil {
		return
	}
	o.mu.Lock()
	var ids []string
	for id, e := range o.entries {
		if e.op == nil && e.rec.State == StatePaused && e.rec.Handoff != "" {
			ids = append(ids, id)
		}
	}
	o.mu.Unlock()
	for _, id := range ids {
		o.reconcileHandoff(ctx, hf, id)
	}
}

func (o *Orchestrator) reconcileHandoff(ctx context.Context, hf *handoff, id string) {
	o.mu.Lock()
	e := o.entries[id]
	if e == nil || e.op != nil || e.rec.State != StatePaused || e.rec.Handoff == "" {
		o.mu.Unlock()
		return
	}
	hid := e.rec.Handoff
	o.mu.Unlock()
	moved, err := hf.h.HandoffClaimedElsewhere(ctx, hid, hf.node)
	if err != nil || !moved {
		if err != nil {
			o.log.Debug("check a handoff", "sandbox", id, "err", err)
		}
		return
	}
	e, _, err = o.acquire(ctx, id, waitOpts{})
	if err != nil {
		return
	}
	if e.rec.State != StatePaused || e.rec.Handoff != hid {
		o.mu.Unlock()
		return
	}
	p, _ := o.begin(e, StateKilling)
	o.forget(ctx, e, p, nil)
}
