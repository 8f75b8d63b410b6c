package server

import (
	"context"
	"fmt"
	"maps"
	"slices"
	"strconv"
	"sync"
	"time"

	"github.com/aenv-dev/aenv/internal/orchestrator"
	"github.com/aenv-dev/aenv/internal/sandbox"
)

// fakeOrch is a minimal in-memory Orchestrator with E2B semantics, for handler tests that
// must control every outcome (errors, endpoints) directly.
type fakeOrch struct {
	mu        sync.Mutex
	now       time.Time
	sandboxes map[string]*orchestrator.Sandbox
	endpoints map[string]sandbox.Endpoint
	templates map[string]bool
	createErr error
	lastReq   orchestrator.CreateRequest
	lastTTL   time.Duration
	nextID    int

	caps        sandbox.Capabilities
	snapshots   []orchestrator.SnapshotInfo // newest last
	snapErr     error
	forkErr     error
	forkFail    map[int]error // child index → error
	lastFork    [2]int        // count, timeout seconds
	lastConnect orchestrator.ConnectOptions
	lastPause   sandbox.PauseOptions
}

func newFakeOrch() *fakeOrch {
	return &fakeOrch{
		now:       time.Date(2026, 1, 2, 3, 4, 5, 0, time.UTC),
		sandboxes: map[string]*orchestrator.Sandbox{},
		endpoints: map[string]sandbox.Endpoint{},
		templates: map[string]bool{"base": true},
	}
}

// add registers a sandbox directly (state, metadata, start time controlled by the test).
func (f *fakeOrch) add(sb *orchestrator.Sandbox) {
	f.mu.Lock()
	defer f.mu.Unlock()
	if sb.EnvdVersion == "" {
		sb.EnvdVersion = "0.5.15"
	}
	f.sandboxes[sb.ID] = sb
}

func (f *fakeOrch) Create(_ context.Context, req orchestrator.CreateRequest) (*orchestrator.Sandbox, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.lastReq = req
	if f.createErr != nil {
		return nil, f.createErr
	}
	if !f.templates[req.TemplateID] {
		return nil, fmt.Errorf("template %q: %w", req.TemplateID, orchestrator.ErrTemplateNotFound)
	}
	f.nextID++
	sb := &orchestrator.Sandbox{
		ID: "sbx" + strconv.Itoa(f.nextID), TemplateID: req.TemplateID, State: orchestrator.StateRunning,
		StartedAt: f.now, EndAt: f.now.Add(req.Timeout), Metadata: req.Metadata, EnvVars: req.EnvVars,
		EnvdVersion: "0.5.15", AutoPause: req.AutoPause, AutoResume: req.AutoResume, AllowInternet: req.AllowInternet,
		Resources: sandbox.Resources{CPUCount: 2, MemoryMB: 512, DiskSizeMB: 2048},
		Private:   req.Private, TrafficAccessToken: "traffic-" + strconv.Itoa(f.nextID), VolumeMounts: req.VolumeMounts,
	}
	if req.Secure {
		sb.EnvdAccessToken = "tok-" + sb.ID
	}
	f.sandboxes[sb.ID] = sb
	return sb, nil
}

func (f *fakeOrch) get(id string) (*orchestrator.Sandbox, error) {
	sb, ok := f.sandboxes[id]
	if !ok {
		return nil, fmt.Errorf("sandbox %q: %w", id, orchestrator.ErrNotFound)
	}
	return sb, nil
}

func (f *fakeOrch) Connect(_ context.Context, id string, o orchestrator.ConnectOptions) (*orchestrator.Sandbox, bool, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	sb, err := f.get(id)
	if err != nil {
		return nil, false, err
	}
	f.lastTTL = o.Timeout
	f.lastConnect = o
	if sb.State == orchestrator.StatePaused {
		sb.State = orchestrator.StateRunning
		sb.EndAt = f.now.Add(o.Timeout)
		return sb, true, nil
	}
	if end := f.now.Add(o.Timeout); end.After(sb.EndAt) {
		sb.EndAt = end
	}
	return sb, false, nil
}

func (f *fakeOrch) Get(_ context.Context, id string) (*orchestrator.Sandbox, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.get(id)
}

// List filters like the orchestrator and pages with an offset token.
func (f *fakeOrch) List(_ context.Context, fl orchestrator.ListFilter) ([]*orchestrator.Sandbox, string, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	var all []*orchestrator.Sandbox
	for _, sb := range f.sandboxes {
		if len(fl.States) > 0 && !slices.Contains(fl.States, sb.State.Public()) {
			continue
		}
		if fl.TemplateID != "" && sb.TemplateID != fl.TemplateID {
			continue
		}
		if sb.StartedAt.Before(fl.StartedAfter) {
			continue
		}
		match := true
		for k, v := range fl.Metadata {
			if sb.Metadata[k] != v {
				match = false
			}
		}
		if match {
			all = append(all, sb)
		}
	}
	slices.SortFunc(all, func(a, b *orchestrator.Sandbox) int {
		if c := a.StartedAt.Compare(b.StartedAt); c != 0 {
			if fl.Ascending {
				return c
			}
			return -c
		}
		return cmpString(a.ID, b.ID)
	})
	off := 0
	if fl.NextToken != "" {
		n, err := strconv.Atoi(fl.NextToken)
		if err != nil {
			return nil, "", fmt.Errorf("%w: bad nextToken", orchestrator.ErrInvalid)
		}
		off = n
	}
	limit := fl.Limit
	if limit <= 0 {
		limit = 100
	}
	if off > len(all) {
		off = len(all)
	}
	end := min(off+limit, len(all))
	next := ""
	if end < len(all) {
		next = strconv.Itoa(end)
	}
	return all[off:end], next, nil
}

func cmpString(a, b string) int {
	switch {
	case a < b:
		return -1
	case a > b:
		return 1
	}
	return 0
}

func (f *fakeOrch) Kill(_ context.Context, id string) error {
	f.mu.Lock()
	defer f.mu.Unlock()
	if _, err := f.get(id); err != nil {
		return err
	}
	delete(f.sandboxes, id)
	return nil
}

func (f *fakeOrch) SetTimeout(_ context.Context, id string, d time.Duration) error {
	f.mu.Lock()
	defer f.mu.Unlock()
	sb, err := f.get(id)
	if err != nil {
		return err
	}
	f.lastTTL = d
	sb.EndAt = f.now.Add(d)
	return nil
}

func (f *fakeOrch) Refresh(_ context.Context, id string, d time.Duration) error {
	f.mu.Lock()
	defer f.mu.Unlock()
	sb, err := f.get(id)
	if err != nil {
		return err
	}
	f.lastTTL = d
	if end := f.now.Add(d); end.After(sb.EndAt) {
		sb.EndAt = end
	}
	return nil
}

func (f *fakeOrch) Pause(_ context.Context, id string, o sandbox.PauseOptions) error {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.lastPause = o
	sb, err := f.get(id)
	if err != nil {
		return err
	}
	if sb.State == orchestrator.StatePaused {
		return fmt.Errorf("sandbox %q is already paused: %w", id, orchestrator.ErrConflict)
	}
	sb.State = orchestrator.StatePaused
	return nil
}

func (f *fakeOrch) Metrics(_ context.Context, id string) ([]sandbox.Stats, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	if _, err := f.get(id); err != nil {
		return nil, err
	}
	return []sandbox.Stats{
		{Timestamp: f.now.Add(-10 * time.Second), CPUCount: 2, CPUUsedPct: 1.5, MemUsed: 10, MemTotal: 100},
		{Timestamp: f.now, CPUCount: 2, CPUUsedPct: 3, MemUsed: 20, MemTotal: 100, DiskUsed: 5, DiskTotal: 50},
	}, nil
}

func (f *fakeOrch) Endpoint(_ context.Context, id string, autoResume bool) (sandbox.Endpoint, *orchestrator.Sandbox, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	sb, err := f.get(id)
	if err != nil {
		return sandbox.Endpoint{}, nil, err
	}
	if sb.State == orchestrator.StatePaused {
		if !autoResume || !sb.AutoResume {
			return sandbox.Endpoint{}, nil, fmt.Errorf("sandbox %q: %w", id, orchestrator.ErrPaused)
		}
		sb.State = orchestrator.StateRunning
	}
	ep, ok := f.endpoints[id]
	if !ok {
		return sandbox.Endpoint{}, nil, fmt.Errorf("sandbox %q has no endpoint: %w", id, orchestrator.ErrNotRunning)
	}
	cp := *sb
	cp.Metadata = maps.Clone(sb.Metadata)
	return ep, &cp, nil
}

// fakeAuth accepts exactly one key.
type fakeAuth struct{ key string }

func (a fakeAuth) Authenticate(_ context.Context, key string) (bool, error) { return key == a.key, nil }

// Config reports the defaults the real orchestrator fills unset resources with.
func (f *fakeOrch) Config() orchestrator.Config {
	return orchestrator.Config{DefaultResources: sandbox.Resources{CPUCount: 3, MemoryMB: 768}}
}
