package orchestrator

import (
	"context"
	"errors"
	"fmt"
	"maps"
	"time"

	"github.com/aenv-dev/aenv/internal/catalog"
	"github.com/aenv-dev/aenv/internal/sandbox"
	"github.com/aenv-dev/aenv/internal/sandboxconn"
)

// Create starts a sandbox from a template or snapshot (by id or alias) and returns
// once envd has been initialised and the sandbox is Running with its TTL armed. Any
// failure leaves nothing behind: the instance is stopped and no record remains.
//
// Errors: ErrInvalid (bad request), ErrTemplateNotFound, ErrCapacity (limit reached
// or shutting down), anything else is a backend or envd failure.
func (o *Orchestrator) Create(ctx context.Context, req CreateRequest) (*Sandbox, error) {
	start := time.Now()
	m := o.metricsFor(req.Metadata)
	sb, err := o.create(ctx, req)
	m.observe(opCreate, stageTotal, start, err)
	if err != nil {
		m.creates.WithLabelValues("error").Inc()
		if !errors.Is(err, ErrInvalid) && !errors.Is(err, ErrTemplateNotFound) && !errors.Is(err, ErrCapacity) &&
			!errors.Is(err, ErrUnsupported) {
			m.failures.WithLabelValues(opCreate).Inc()
			o.log.Error("create sandbox", "template", req.TemplateID, "err", err)
		}
		return nil, err
	}
	m.creates.WithLabelValues("ok").Inc()
	o.log.Debug("sandbox created", "sandbox", sb.ID, "template", sb.TemplateID, "took", time.Since(start))
	return sb, nil
}

func validateCreate(req CreateRequest) error {
	if req.TemplateID == "" {
		return fmt.Errorf("%w: templateID is required", ErrInvalid)
	}
	r := req.Resources
	if r.CPUCount < 0 || r.MemoryMB < 0 || r.DiskSizeMB < 0 {
		return fmt.Errorf("%w: cpuCount, memoryMB and diskSizeMB must not be negative", ErrInvalid)
	}
	for k := range req.EnvVars {
		if k == "" {
			return fmt.Errorf("%w: environment variable with an empty name", ErrInvalid)
		}
	}
	for k := range req.Metadata {
		if k == "" {
			return fmt.Errorf("%w: metadata key is empty", ErrInvalid)
		}
	}
	return nil
}

// pick returns the first positive value.
func pick(vals ...int) int {
	for _, v := range vals {
		if v > 0 {
			return v
		}
	}
	return 0
}

func (o *Orchestrator) create(ctx context.Context, req CreateRequest) (*Sandbox, error) {
	if err := validateCreate(req); err != nil {
		return nil, err
	}
	timeout, err := o.validTimeout(req.Timeout)
	if err != nil {
		return nil, err
	}
	var tpl catalog.Template
	err = o.metricsFor(req.Metadata).timeStage(opCreate, stageResolve, func() (err error) {
		tpl, err = o.cat.Templates().Resolve(req.TemplateID)
		if errors.Is(err, catalog.ErrNotFound) && o.cfg.TemplateFetch != nil {
			if ok, ferr := o.cfg.TemplateFetch(ctx, req.TemplateID); ferr != nil {
				o.log.Warn("fetch an unknown template from the repository", "template", req.TemplateID, "err", ferr)
			} else if ok {
				tpl, err = o.cat.Templates().Resolve(req.TemplateID)
			}
		}
		return err
	})
	if errors.Is(err, catalog.ErrNotFound) {
		if o.cfg.TemplatePending != nil {
			if perr := o.cfg.TemplatePending(req.TemplateID); perr != nil {
				return nil, fmt.Errorf("%w: %w", ErrTemplateNotReady, perr)
			}
		}
		return nil, fmt.Errorf("%w: %q", ErrTemplateNotFound, req.TemplateID)
	} else if err != nil {
		return nil, fmt.Errorf("resolve template %q: %w", req.TemplateID, err)
	}
	id, err := newID()
	if err != nil {
		return nil, err
	}
	alias := req.TemplateID
	if alias == tpl.ID {
		alias = ""
		if len(tpl.Aliases) > 0 {
			alias = tpl.Aliases[0]
		}
	}
	rec := Sandbox{
		ID:         id,
		TemplateID: tpl.ID,
		Alias:      alias,
		State:      StateCreating,
		Resources: sandbox.Resources{
			CPUCount:   pick(req.Resources.CPUCount, tpl.Resources.CPUCount, o.cfg.DefaultResources.CPUCount),
			MemoryMB:   pick(req.Resources.MemoryMB, tpl.Resources.MemoryMB, o.cfg.DefaultResources.MemoryMB),
			DiskSizeMB: pick(req.Resources.DiskSizeMB, tpl.Resources.DiskSizeMB, o.cfg.DefaultResources.DiskSizeMB),
		},
		Metadata:           maps.Clone(req.Metadata),
		EnvVars:            maps.Clone(req.EnvVars),
		TrafficAccessToken: o.TrafficAccessToken(id),
		AutoPause:          req.AutoPause,
		AutoResume:         req.AutoResume,
		AllowInternet:      req.AllowInternet,
		Egress:             req.Egress,
		MaskRequestHost:    req.MaskRequestHost,
		Private:            req.Private,
		Backend:            o.backend.Name(),
		Launch: LaunchInfo{
			RootFS:          sandbox.RootFS{LowerDir: o.directory(tpl.RootFSDir)},
			TemplateEnvVars: maps.Clone(tpl.EnvVars),
			DefaultUser:     tpl.DefaultUser,
			DefaultWorkdir:  tpl.DefaultWorkdir,
			StartCmd:        tpl.StartCmd,
		},
	}
	if err := o.cfg.Capacity.Check(rec.Resources); err != nil {
		return nil, fmt.Errorf("%w: %w", ErrInvalid, err)
	}
	rec.Owner = req.Owner
	if rec.VolumeMounts, rec.Launch.Mounts, err = o.resolveMounts(req.Owner, req.VolumeMounts, tpl); err != nil {
		return nil, err
	}
	if req.Secure {
		rec.EnvdAccessToken = o.EnvdAccessToken(id)
	}
	rec.AutoPauseDisk = req.AutoPauseDisk
	plan := sandbox.LaunchPlan{Kind: sandbox.LaunchFresh, SandboxID: id, RootFS: rec.Launch.RootFS,
		Resources: rec.Resources, AllowInternet: rec.AllowInternet, Mounts: rec.Launch.Mounts, FlatRoot: req.FlatRoot}
	held := ""
	if tpl.Kind == catalog.KindTemplate {
		fs, err := o.templateRoot(tpl)
		if err != nil {
			return nil, err
		}
		rec.Launch.RootFS, plan.RootFS = fs, fs
	}
	if tpl.Kind == catalog.KindSnapshot {
		c, err := o.decodeSnapshotTemplate(opCreate, tpl)
		if err != nil {
			return nil, err
		}
		plan.Kind, plan.Snapshot, plan.SnapshotTemplate = sandbox.LaunchFromSnapshot, c, true
		rec.Launch.ParentSnapshot = tpl.ID
		// The snapshot's memory (a backend that keeps processes) holds its source's envd.
		held = tpl.EnvdAccessToken
	}
	return o.start(ctx, opCreate, rec, plan, timeout, held)
}

// templateRoot is the root filesystem of sandboxes created from template t: its layer
// stack, plus its directory for a backend that boots directories (sandbox.DirectoryBooter).
// A template without layers on a backend that boots only layered roots is refused here,
// so such a backend never sees a directory.
func (o *Orchestrator) templateRoot(t catalog.Template) (sandbox.RootFS, error) {
	ls, err := t.Layers()
	if err != nil {
		return sandbox.RootFS{}, fmt.Errorf("template %s: root filesystem: %w", t.ID, err)
	}
	var fs sandbox.RootFS
	if ls != nil {
		fs = ls.RootFS()
	}
	boots := o.bootsDirectories()
	if boots {
		fs.LowerDir = t.RootFSDir
	}
	if len(fs.Layers) == 0 && !boots {
		return fs, fmt.Errorf("%w: template %s has no layers (a directory template) and backend %s boots layered templates only; "+
			"pull the image with conversion (aenv pull --convert) or rebuild the template on a layered base",
			ErrUnsupported, t.ID, o.backend.Name())
	}
	return fs, nil
}

// directory is dir for a backend that boots directory roots, else "".
func (o *Orchestrator) directory(dir string) string {
	if o.bootsDirectories() {
		return dir
	}
	return ""
}

func (o *Orchestrator) bootsDirectories() bool {
	b, ok := o.backend.(sandbox.DirectoryBooter)
	return ok && b.BootsDirectories()
}

// decodeSnapshotTemplate turns a snapshot template's artifact back into a capture the
// backend can launch from.
func (o *Orchestrator) decodeSnapshotTemplate(operation string, tpl catalog.Template) (sandbox.Captured, error) {
	if !o.backend.Capabilities().Snapshots {
		return nil, fmt.Errorf("%w: backend %s cannot start sandboxes from snapshots (%s)", ErrUnsupported, o.backend.Name(), tpl.ID)
	}
	if tpl.Backend != "" && tpl.Backend != o.backend.Name() {
		return nil, fmt.Errorf("%w: snapshot %s was taken on backend %s, this node runs %s", ErrInvalid, tpl.ID, tpl.Backend, o.backend.Name())
	}
	var c sandbox.Captured
	err := o.m.timeStage(operation, stageDecode, func() (err error) {
		c, err = o.backend.DecodeCaptured(tpl.Artifact)
		return err
	})
	if err != nil {
		return nil, fmt.Errorf("snapshot %s: %w", tpl.ID, err)
	}
	return c, nil
}

// start registers a new sandbox record, launches it from plan and returns once it is
// Running with TTL now+timeout. held is the envd token the launched memory may hold
// (initEnvd). Any failure leaves nothing behind.
func (o *Orchestrator) start(ctx context.Context, operation string, rec Sandbox, plan sandbox.LaunchPlan, timeout time.Duration, held string) (*Sandbox, error) {
	id := rec.ID
	rec.State = StateCreating
	e := &entry{rec: rec}
	p := &op{kind: StateCreating, done: make(chan struct{})}
	e.op = p
	o.mu.Lock()
	if err := o.admitLocked(rec.Resources); err != nil {
		o.mu.Unlock()
		return nil, err
	}
	if _, dup := o.entries[id]; dup {
		o.mu.Unlock()
		return nil, fmt.Errorf("sandbox id collision on %s", id)
	}
	o.entries[id] = e
	o.mu.Unlock()
	// Pinned before the launch reads the layers; remove unpins on any failure.
	o.pin(id, rec.TemplateID)

	octx, cancel := o.opContext(ctx)
	defer cancel()
	inst, version, err := o.launch(octx, operation, plan, &rec, held)
	if err != nil {
		o.remove(e, p, err)
		return nil, err
	}
	now := o.clock.Now()
	o.mu.Lock()
	e.inst = inst
	e.rec.EnvdVersion = version
	e.rec.StartedAt = now.UTC()
	e.rec.EndAt = now.Add(timeout).UTC()
	o.mu.Unlock()
	if err := o.metricsFor(rec.Metadata).timeStage(operation, stagePersist, func() error { return o.persist(e) }); err != nil {
		o.stopQuietly(octx, inst)
		o.remove(e, p, err)
		return nil, err
	}
	o.mu.Lock()
	o.armLocked(e)
	o.mu.Unlock()
	return o.finish(e, p, StateRunning, nil), nil
}

// launch runs the backend launch, waits for envd and initialises it, timing each
// stage under operation. On failure the instance is stopped before returning.
func (o *Orchestrator) launch(ctx context.Context, operation string, plan sandbox.LaunchPlan, rec *Sandbox, held string) (sandbox.Instance, string, error) {
	var inst sandbox.Instance
	m := o.metricsFor(rec.Metadata)
	plan.EnvdAccessToken, plan.HeldEnvdToken = rec.EnvdAccessToken, held
	err := m.timeStage(operation, stageLaunch, func() (err error) {
		inst, err = o.backend.Launch(ctx, plan)
		return err
	})
	if err != nil {
		return nil, "", fmt.Errorf("launch sandbox %s: %w", plan.SandboxID, err)
	}
	// Before envd runs anything (the start command included) under the old policy.
	if err := o.applyEgress(ctx, inst, rec); err != nil {
		o.stopQuietly(ctx, inst)
		return nil, "", fmt.Errorf("sandbox %s: %w", plan.SandboxID, err)
	}
	ep := inst.Endpoint()
	// The sandbox's own connection pool (when the envd client is the proxy's): the
	// connection /health and /init use stays open for the sandbox's first command.
	ectx := sandboxconn.WithSandbox(ctx, rec.ID)
	if err := m.timeStage(operation, stageEnvdWait, func() error { return o.waitEnvd(ectx, ep) }); err != nil {
		o.stopQuietly(ctx, inst)
		return nil, "", fmt.Errorf("sandbox %s: %w", plan.SandboxID, err)
	}
	restored := o.backend.Capabilities().MemorySnapshots && plan.Kind != sandbox.LaunchFresh && !plan.ColdBoot
	var version string
	err = m.timeStage(operation, stageEnvdInit, func() (err error) {
		version, err = o.initEnvd(ectx, ep, rec, held, restored)
		return err
	})
	if err != nil {
		o.stopQuietly(ctx, inst)
		return nil, "", fmt.Errorf("sandbox %s: %w", plan.SandboxID, err)
	}
	if o.wantsEgressCA(rec) {
		// Without it HTTPS to the domains of the rules fails verification, but the rest
		// of the sandbox works: reported, not fatal.
		if err := o.installEgressCA(ctx, ep, rec); err != nil {
			o.log.Warn("install the egress CA", "sandbox", rec.ID, "err", err)
			o.logEvent(rec.ID, LevelWarn, "egress CA not installed: HTTPS to the domains of network.rules will fail verification", map[string]string{"err": err.Error()})
		}
	}
	o.logEvent(rec.ID, LevelInfo, "sandbox started", map[string]string{"operation": operation})
	if runsFreshProcesses(plan, o.backend.Capabilities()) {
		// A start command that cannot be started is the template's fault, not the
		// sandbox's: the sandbox is still usable, so it is reported, not fatal.
		if err := o.startTemplateCommand(ctx, ep, rec); err != nil {
			o.log.Warn("template start command did not start", "sandbox", rec.ID, "template", rec.TemplateID, "err", err)
		}
	}
	return inst, version, nil
}

// stopQuietly stops an instance during rollback; the original error is what matters
// to the caller, a failed stop is logged for the operator (Start reconciles it later).
func (o *Orchestrator) stopQuietly(ctx context.Context, inst sandbox.Instance) {
	if err := inst.Stop(context.WithoutCancel(ctx)); err != nil {
		o.log.Error("stop sandbox during rollback", "sandbox", inst.ID(), "err", err)
	}
}
