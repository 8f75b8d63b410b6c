package orchestrator

import (
	"context"
	"fmt"
	"maps"
	"slices"
	"sync"
	"time"

	"github.com/aenv-dev/aenv/internal/sandbox"
)

// Fork limits: E2B accepts 1..100 children per request.
const (
	MaxForkCount = 100
	// forkParallelism bounds concurrent child launches so one large fork cannot starve
	// every other operation on the node.
	forkParallelism = 16
)

// Fork captures a running sandbox once (it keeps running, same id, tokens and TTL) and
// launches count children from the capture, each with its own id, tokens and TTL
// now+timeout (0: the default). The result has one entry per child, in order: its
// sandbox or why it failed. Children inherit the source's resources, metadata,
// environment and lifecycle settings; they continue the source's processes only when
// the backend's Capabilities report LiveFork, otherwise they boot fresh processes on a
// copy of its filesystem.
//
// Errors (nothing was started): ErrInvalid (count outside 1..MaxForkCount, bad
// timeout), ErrNotFound, ErrConflict (paused, pausing or being killed), ErrUnsupported,
// or the capture's failure.
func (o *Orchestrator) Fork(ctx context.Context, id string, count int, timeout time.Duration) ([]ForkResult, error) {
	start := time.Now()
	res, err := o.fork(ctx, id, count, timeout)
	o.m.observe(opFork, stageTotal, start, err)
	if err != nil && !clientError(err) {
		o.m.failures.WithLabelValues(opFork).Inc()
		o.log.Error("fork sandbox", "sandbox", id, "err", err)
	}
	return res, err
}

func (o *Orchestrator) fork(ctx context.Context, id string, count int, timeout time.Duration) ([]ForkResult, error) {
	if count < 1 || count > MaxForkCount {
		return nil, fmt.Errorf("%w: count must be between 1 and %d, got %d", ErrInvalid, MaxForkCount, count)
	}
	timeout, err := o.validTimeout(timeout)
	if err != nil {
		return nil, err
	}
	if !o.backend.Capabilities().Snapshots {
		return nil, fmt.Errorf("%w: backend %s cannot fork sandboxes", ErrUnsupported, o.backend.Name())
	}
	e, err := o.acquireRunning(ctx, id)
	if err != nil {
		return nil, err
	}
	p, _ := o.begin(e, StateForking)
	octx, cancel := o.opContext(ctx)
	defer cancel()
	c, _, err := o.capture(octx, opFork, e, p)
	if err != nil {
		return nil, err
	}
	o.crashPoint(opFork, stageCapture)
	// The source is done once captured; children launch without holding it.
	src := o.finish(e, p, StateRunning, nil)
	defer o.discardCapture(octx, c)

	out := make([]ForkResult, count)
	var wg sync.WaitGroup
	sem := make(chan struct{}, forkParallelism)
	for n := range out {
		wg.Add(1)
		sem <- struct{}{}
		go func() {
			defer func() { <-sem; wg.Done() }()
			sb, err := o.forkChild(octx, src, c, timeout)
			out[n] = ForkResult{Sandbox: sb, Err: err}
			if err == nil {
				o.crashPoint(opFork, stageLaunch)
			}
		}()
	}
	wg.Wait()
	return out, nil
}

// forkChild launches one child of src from capture c.
func (o *Orchestrator) forkChild(ctx context.Context, src *Sandbox, c sandbox.Captured, timeout time.Duration) (*Sandbox, error) {
	id, err := newID()
	if err != nil {
		return nil, err
	}
	rec := Sandbox{
		ID:                 id,
		TemplateID:         src.TemplateID,
		Alias:              src.Alias,
		Resources:          src.Resources,
		Metadata:           maps.Clone(src.Metadata),
		EnvVars:            maps.Clone(src.EnvVars),
		TrafficAccessToken: o.TrafficAccessToken(id),
		AutoPause:          src.AutoPause,
		AutoPauseDisk:      src.AutoPauseDisk,
		AutoResume:         src.AutoResume,
		AllowInternet:      src.AllowInternet,
		Egress:             src.Egress,
		MaskRequestHost:    src.MaskRequestHost,
		Private:            src.Private,
		Backend:            o.backend.Name(),
		Launch:             src.Launch,
		Owner:              src.Owner,
		VolumeMounts:       slices.Clone(src.VolumeMounts),
	}
	rec.Launch.TemplateEnvVars = maps.Clone(src.Launch.TemplateEnvVars)
	if src.EnvdAccessToken != "" {
		rec.EnvdAccessToken = o.EnvdAccessToken(id)
	}
	plan := sandbox.LaunchPlan{Kind: sandbox.LaunchFromSnapshot, SandboxID: id, RootFS: rec.Launch.RootFS,
		Resources: rec.Resources, AllowInternet: rec.AllowInternet, Snapshot: c, Mounts: rec.Launch.Mounts}
	// The children's envd holds the source's token (its memory is the source's).
	sb, err := o.start(ctx, opFork, rec, plan, timeout, src.EnvdAccessToken)
	if err != nil {
		return nil, fmt.Errorf("fork child of %s: %w", src.ID, err)
	}
	return sb, nil
}
