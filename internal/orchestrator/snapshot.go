package orchestrator

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"maps"
	"slices"
	"strings"
	"time"

	"github.com/aenv-dev/aenv/internal/catalog"
	"github.com/aenv-dev/aenv/internal/sandbox"
	"github.com/aenv-dev/aenv/internal/snapshot"
)

// Snapshot captures a running sandbox, which keeps running with the same id, tokens and
// TTL, and registers the capture as a template of kind snapshot (a new id, plus name as
// its alias when given). Sandboxes can then be created from the snapshot by id or name.
//
// Errors: ErrInvalid (bad name), ErrConflict (name taken; sandbox paused, pausing or
// being killed), ErrNotFound, ErrUnsupported (the backend cannot snapshot). A failed
// capture leaves the sandbox running, unless the backend reports it gone.
func (o *Orchestrator) Snapshot(ctx context.Context, id, name string) (SnapshotInfo, error) {
	start := time.Now()
	info, err := o.snapshot(ctx, id, name)
	o.m.observe(opSnapshot, stageTotal, start, err)
	if err != nil && !clientError(err) {
		o.m.failures.WithLabelValues(opSnapshot).Inc()
		o.log.Error("snapshot sandbox", "sandbox", id, "err", err)
	}
	return info, err
}

// clientError reports errors that say the request was wrong, not the node.
func clientError(err error) bool {
	for _, e := range []error{ErrInvalid, ErrNotFound, ErrConflict, ErrTemplateNotFound, ErrUnsupported, ErrCapacity} {
		if errors.Is(err, e) {
			return true
		}
	}
	return false
}

func (o *Orchestrator) snapshot(ctx context.Context, id, name string) (SnapshotInfo, error) {
	if name != "" && !catalog.ValidName(name) {
		return SnapshotInfo{}, fmt.Errorf("%w: snapshot name %q must be 1-128 letters, digits, '.', '_' or '-', starting with a letter or digit", ErrInvalid, name)
	}
	if !o.backend.Capabilities().Snapshots {
		return SnapshotInfo{}, fmt.Errorf("%w: backend %s cannot snapshot sandboxes", ErrUnsupported, o.backend.Name())
	}
	if name != "" {
		if _, err := o.cat.Templates().Resolve(name); err == nil {
			return SnapshotInfo{}, fmt.Errorf("%w: name %q is already used by a template or snapshot", ErrConflict, name)
		}
	}
	e, err := o.acquireRunning(ctx, id)
	if err != nil {
		return SnapshotInfo{}, err
	}
	p, _ := o.begin(e, StateSnapshotting)
	octx, cancel := o.opContext(ctx)
	defer cancel()
	c, raw, err := o.capture(octx, opSnapshot, e, p)
	if err != nil {
		return SnapshotInfo{}, err
	}
	o.crashPoint(opSnapshot, stageCapture)
	o.mu.Lock()
	src := e.clone()
	o.mu.Unlock()
	snapID, err := newID()
	tpl := snapshotTemplate(src, snapID, name, raw, o.clock.Now())
	o.regMu.RLock()
	if err == nil {
		err = o.m.timeStage(opSnapshot, stageRegister, func() error { return o.cat.Templates().Put(tpl) })
	}
	publication := PublicationNone
	if err == nil {
		o.crashPoint(opSnapshot, stageRegister)
		// Usable here already; other nodes get it when the background upload completes.
		publication = o.publish(octx, tpl, src.EnvdVersion)
		o.crashPoint(opSnapshot, stagePublish)
	}
	o.regMu.RUnlock()
	if err != nil {
		o.discardCapture(octx, c)
		if errors.Is(err, catalog.ErrAliasTaken) {
			err = fmt.Errorf("%w: %w", ErrConflict, err)
		} else {
			err = fmt.Errorf("register snapshot of %s: %w", id, err)
		}
		o.finish(e, p, StateRunning, err)
		return SnapshotInfo{}, err
	}
	o.finish(e, p, StateRunning, nil)
	info := SnapshotInfo{SnapshotID: snapID, Names: []string{}, SourceSandboxID: id,
		ParentID: src.Launch.ParentSnapshot, CreatedAt: o.clock.Now().UTC(), Publication: publication}
	if name != "" {
		info.Names = []string{name}
	}
	return info, nil
}

// snapshotTemplate is the catalog record of a snapshot of src: sandboxes created from
// it get src's resources, environment (template's and the sandbox's own) and user.
func snapshotTemplate(src *Sandbox, snapID, name string, raw []byte, now time.Time) catalog.Template {
	env := maps.Clone(src.Launch.TemplateEnvVars)
	if env == nil {
		env = map[string]string{}
	}
	maps.Copy(env, src.EnvVars)
	t := catalog.Template{
		ID:              snapID,
		Kind:            catalog.KindSnapshot,
		RootFSDir:       src.Launch.RootFS.LowerDir,
		Resources:       src.Resources,
		EnvVars:         env,
		DefaultUser:     src.Launch.DefaultUser,
		DefaultWorkdir:  src.Launch.DefaultWorkdir,
		StartCmd:        src.Launch.StartCmd,
		SourceSandboxID: src.ID,
		ParentID:        src.Launch.ParentSnapshot,
		Backend:         src.Backend,
		EnvdAccessToken: src.EnvdAccessToken,
		Artifact:        json.RawMessage(raw),
		CreatedAt:       now.UTC(),
		VolumeMounts:    slices.Clone(src.VolumeMounts),
	}
	if name != "" {
		t.Aliases = []string{name}
	}
	return t
}

// acquireRunning returns e stable and Running with o.mu held. Snapshot and fork wait
// out other operations but refuse a sandbox that is pausing, paused or being killed.
func (o *Orchestrator) acquireRunning(ctx context.Context, id string) (*entry, error) {
	e, _, err := o.acquire(ctx, id, waitOpts{conflict: []State{StateKilling, StatePausing}})
	if err != nil {
		return nil, err
	}
	if e.rec.State != StateRunning || e.inst == nil {
		st := e.rec.State
		o.mu.Unlock()
		return nil, fmt.Errorf("%w: sandbox %s is %s", ErrConflict, id, st)
	}
	return e, nil
}

// capture snapshots e's instance during transition p and encodes the result. On
// failure the transition is settled and the error returned: a recoverable failure
// leaves the sandbox Running, an ErrGone one removes it.
func (o *Orchestrator) capture(ctx context.Context, operation string, e *entry, p *op) (sandbox.Captured, []byte, error) {
	c, raw, err := o.captureInstance(ctx, operation, e)
	if err != nil {
		return nil, nil, o.captureFailed(ctx, e, p, err)
	}
	return c, raw, nil
}

// captureInstance snapshots e's instance and encodes the capture, leaving the
// transition to the caller. A backend that cannot capture this sandbox answers an
// error wrapping ErrUnsupported.
func (o *Orchestrator) captureInstance(ctx context.Context, operation string, e *entry) (sandbox.Captured, []byte, error) {
	o.mu.Lock()
	inst, id, m := e.inst, e.rec.ID, o.metricsFor(e.rec.Metadata)
	o.mu.Unlock()
	var c sandbox.Captured
	err := m.timeStage(operation, stageCapture, func() (err error) {
		c, err = inst.Snapshot(ctx)
		return err
	})
	var raw []byte
	if err == nil {
		if raw, err = c.Encode(); err == nil && !json.Valid(raw) {
			err = errors.New("backend encoded its capture as something other than JSON")
		}
		if err != nil {
			o.discardCapture(ctx, c)
			err = fmt.Errorf("encode snapshot: %w", err)
		}
	}
	if err == nil {
		return c, raw, nil
	}
	if errors.Is(err, sandbox.ErrUnsupported) {
		err = fmt.Errorf("%w: %w", ErrUnsupported, err)
	}
	return nil, nil, fmt.Errorf("snapshot sandbox %s: %w", id, err)
}

// captureFailed settles transition p after a failed capture and returns err.
func (o *Orchestrator) captureFailed(ctx context.Context, e *entry, p *op, err error) error {
	if errors.Is(err, sandbox.ErrGone) {
		o.mu.Lock()
		inst := e.inst
		o.mu.Unlock()
		o.stopQuietly(ctx, inst)
		o.remove(e, p, err)
		o.m.kills.WithLabelValues("failure").Inc()
		return err
	}
	o.mu.Lock()
	o.armLocked(e)
	o.mu.Unlock()
	o.finish(e, p, StateRunning, err)
	return err
}

// discardCapture tells the backend a capture is no longer referenced by the orchestrator.
func (o *Orchestrator) discardCapture(ctx context.Context, c sandbox.Captured) {
	d, ok := o.backend.(sandbox.SnapshotDiscarder)
	if !ok || c == nil {
		return
	}
	if err := d.DiscardSnapshot(context.WithoutCancel(ctx), c); err != nil {
		o.log.Error("discard snapshot", "err", err)
	}
}

// ListSnapshots returns one page of snapshots matching f, newest first, and the token
// of the next page ("" on the last). Limit outside 1..MaxListLimit or a malformed token
// is ErrInvalid.
func (o *Orchestrator) ListSnapshots(ctx context.Context, f SnapshotFilter) ([]SnapshotInfo, string, error) {
	limit := f.Limit
	if limit == 0 {
		limit = DefaultListLimit
	}
	if limit < 1 || limit > MaxListLimit {
		return nil, "", fmt.Errorf("%w: limit must be between 1 and %d", ErrInvalid, MaxListLimit)
	}
	var cur *cursor
	if f.NextToken != "" {
		c, err := decodeCursor(f.NextToken)
		if err != nil {
			return nil, "", err
		}
		cur = &c
	}
	tpls, err := o.cat.Templates().List(catalog.KindSnapshot)
	if err != nil {
		return nil, "", fmt.Errorf("list snapshots: %w", err)
	}
	order := func(a, b catalog.Template) int {
		if c := b.CreatedAt.Compare(a.CreatedAt); c != 0 {
			return c
		}
		return strings.Compare(b.ID, a.ID)
	}
	slices.SortFunc(tpls, order)
	var out []SnapshotInfo
	next := ""
	for _, t := range tpls {
		if snapshot.IsHandoff(t.ID) {
			continue // a paused sandbox resumed here, not a snapshot anyone took
		}
		if f.SandboxID != "" && t.SourceSandboxID != f.SandboxID {
			continue
		}
		if f.Name != "" && t.ID != f.Name && !slices.Contains(t.Aliases, f.Name) {
			continue
		}
		// Skip up to and including the cursor (the last item already returned).
		if cur != nil && order(t, catalog.Template{ID: cur.id, CreatedAt: cur.startedAt}) <= 0 {
			continue
		}
		if len(out) == limit {
			last := out[limit-1]
			next = encodeCursor(cursor{startedAt: last.CreatedAt, id: last.SnapshotID})
			break
		}
		out = append(out, snapshotInfo(t))
	}
	return out, next, nil
}

func snapshotInfo(t catalog.Template) SnapshotInfo {
	names := slices.Clone(t.Aliases)
	if names == nil {
		names = []string{}
	}
	return SnapshotInfo{SnapshotID: t.ID, Names: names, SourceSandboxID: t.SourceSandboxID,
		ParentID: t.ParentID, CreatedAt: t.CreatedAt}
}

// DeleteTemplate deletes a template or snapshot by id or name (E2B deletes snapshots
// through DELETE /templates/{id}). Sandboxes created from it are not affected: each
// keeps what it needs to run, pause and resume, and backends free a snapshot's
// artifacts only when nothing else references them. Unknown is ErrTemplateNotFound.
//
// With a publisher it is deleted from the repository too (every node sharing it drops
// it at its next sync); a repository fault is logged, the local delete stands.
func (o *Orchestrator) DeleteTemplate(ctx context.Context, idOrName string) error {
	o.regMu.Lock()
	t, err := o.cat.Templates().Delete(idOrName)
	o.regMu.Unlock()
	if errors.Is(err, catalog.ErrNotFound) {
		return fmt.Errorf("%w: %q", ErrTemplateNotFound, idOrName)
	}
	if err != nil {
		return fmt.Errorf("delete template %q: %w", idOrName, err)
	}
	o.DiscardTemplate(ctx, t)
	o.unpublish(ctx, t.ID)
	return nil
}
