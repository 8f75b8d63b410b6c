package server

import (
	"context"
	"fmt"
	"slices"
	"strconv"
	"time"

	"github.com/aenv-dev/aenv/internal/orchestrator"
	"github.com/aenv-dev/aenv/internal/sandbox"
)

// Snapshot, fork and capabilities of the fake orchestrator, with E2B's outcomes.

func (f *fakeOrch) Snapshot(_ context.Context, id, name string) (orchestrator.SnapshotInfo, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	if f.snapErr != nil {
		return orchestrator.SnapshotInfo{}, f.snapErr
	}
	sb, err := f.get(id)
	if err != nil {
		return orchestrator.SnapshotInfo{}, err
	}
	if sb.State == orchestrator.StatePaused {
		return orchestrator.SnapshotInfo{}, fmt.Errorf("%w: sandbox %s is paused", orchestrator.ErrConflict, id)
	}
	info := orchestrator.SnapshotInfo{SnapshotID: "snap" + strconv.Itoa(len(f.snapshots)+1), Names: []string{},
		SourceSandboxID: id, CreatedAt: f.now}
	if name != "" {
		for _, s := range f.snapshots {
			if slices.Contains(s.Names, name) {
				return orchestrator.SnapshotInfo{}, fmt.Errorf("%w: name %q taken", orchestrator.ErrConflict, name)
			}
		}
		info.Names = []string{name}
	}
	f.snapshots = append(f.snapshots, info)
	f.templates[info.SnapshotID] = true
	return info, nil
}

// ListSnapshots pages newest first with an offset token.
func (f *fakeOrch) ListSnapshots(_ context.Context, fl orchestrator.SnapshotFilter) ([]orchestrator.SnapshotInfo, string, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	var all []orchestrator.SnapshotInfo
	for _, s := range slices.Backward(f.snapshots) {
		if fl.SandboxID != "" && s.SourceSandboxID != fl.SandboxID {
			continue
		}
		if fl.Name != "" && s.SnapshotID != fl.Name && !slices.Contains(s.Names, fl.Name) {
			continue
		}
		all = append(all, s)
	}
	off := 0
	if fl.NextToken != "" {
		n, err := strconv.Atoi(fl.NextToken)
		if err != nil {
			return nil, "", fmt.Errorf("%w: malformed nextToken", orchestrator.ErrInvalid)
		}
		off = min(n, len(all))
	}
	end := min(off+fl.Limit, len(all))
	next := ""
	if end < len(all) {
		next = strconv.Itoa(end)
	}
	return all[off:end], next, nil
}

func (f *fakeOrch) DeleteTemplate(_ context.Context, idOrName string) error {
	f.mu.Lock()
	defer f.mu.Unlock()
	for i, s := range f.snapshots {
		if s.SnapshotID == idOrName || slices.Contains(s.Names, idOrName) {
			f.snapshots = slices.Delete(f.snapshots, i, i+1)
			delete(f.templates, s.SnapshotID)
			return nil
		}
	}
	if f.templates[idOrName] {
		delete(f.templates, idOrName)
		return nil
	}
	return fmt.Errorf("%w: %q", orchestrator.ErrTemplateNotFound, idOrName)
}

func (f *fakeOrch) Fork(ctx context.Context, id string, count int, timeout time.Duration) ([]orchestrator.ForkResult, error) {
	f.mu.Lock()
	f.lastFork = [2]int{count, int(timeout / time.Second)}
	forkErr := f.forkErr
	src, err := f.get(id)
	f.mu.Unlock()
	if forkErr != nil {
		return nil, forkErr
	}
	if err != nil {
		return nil, err
	}
	out := make([]orchestrator.ForkResult, count)
	for i := range out {
		if e := f.forkFail[i]; e != nil {
			out[i].Err = e
			continue
		}
		sb, err := f.Create(ctx, orchestrator.CreateRequest{TemplateID: src.TemplateID, Timeout: timeout, Secure: true})
		out[i] = orchestrator.ForkResult{Sandbox: sb, Err: err}
	}
	return out, nil
}

func (f *fakeOrch) Capabilities() sandbox.Capabilities { return f.caps }

func (f *fakeOrch) BackendName() string { return "fake" }
