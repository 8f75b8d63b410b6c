package main

import (
	"context"
	"errors"
	"fmt"
	"io/fs"
	"log/slog"
	"os"
	"path/filepath"

	"github.com/aenv-dev/aenv/internal/atomicfile"

	"github.com/aenv-dev/aenv/internal/cluster/nodeagent"
	"github.com/aenv-dev/aenv/internal/orchestrator"
	"github.com/aenv-dev/aenv/internal/sandbox"
	"github.com/aenv-dev/aenv/internal/server"
)

// drainer drains the node (POST /aenv/drain): it heartbeats as draining at once, so the
// scheduler places nothing new here, then pauses every running sandbox to disk; with a
// repository each is published and resumes on another node through the gateway. The
// drain is kept in the data dir (drainedFile), so a drained node that restarts stays
// drained until it is undrained.
type drainer struct {
	dataDir string
	report  *nodeReport
	orch    *orchestrator.Orchestrator
	agent   *nodeagent.Agent
	log     *slog.Logger
}

func (d *drainer) Drain(ctx context.Context, draining bool) (server.DrainResult, error) {
	// Persisted first: a drain that cannot be kept across a restart changes nothing.
	if err := saveDrained(d.dataDir, draining); err != nil {
		return server.DrainResult{}, err
	}
	d.report.draining.Store(draining)
	res := server.DrainResult{Draining: draining, Paused: []string{}}
	if _, err := d.agent.Beat(ctx, false); err != nil {
		d.log.Warn("heartbeat after a drain change; the next one carries it", "err", err)
	}
	if !draining {
		return res, nil
	}
	f := orchestrator.ListFilter{States: []string{"running"}, Limit: orchestrator.MaxListLimit}
	var ids []string
	for {
		items, next, err := d.orch.List(ctx, f)
		if err != nil {
			return res, err
		}
		for _, sb := range items {
			ids = append(ids, sb.ID)
		}
		if next == "" {
			break
		}
		f.NextToken = next
	}
	for _, id := range ids {
		if err := d.orch.Pause(ctx, id, sandbox.PauseOptions{KeepMemory: false}); err != nil {
			if res.Failed == nil {
				res.Failed = map[string]string{}
			}
			res.Failed[id] = err.Error()
			continue
		}
		res.Paused = append(res.Paused, id)
	}
	d.log.Info("node drained", "paused", len(res.Paused), "failed", len(res.Failed))
	return res, nil
}

// drainedFile, in the node's data dir, marks a drained node (POST /aenv/drain): present,
// the node heartbeats as draining from its first heartbeat on, restarts included, until
// it is undrained. A graceful stop drains too, but only for its last heartbeat: it is
// not kept.
const drainedFile = "cluster-drained"

// loadDrained reports whether the node in dataDir was drained and not undrained since.
func loadDrained(dataDir string) (bool, error) {
	_, err := os.Stat(filepath.Join(dataDir, drainedFile))
	switch {
	case err == nil:
		return true, nil
	case errors.Is(err, fs.ErrNotExist):
		return false, nil
	}
	return false, fmt.Errorf("read the node's drain state: %w", err)
}

func saveDrained(dataDir string, draining bool) error {
	path := filepath.Join(dataDir, drainedFile)
	if draining {
		if err := atomicfile.WriteFile(path, []byte("drained through POST /aenv/drain; undrain to remove\n"), 0o644); err != nil {
			return fmt.Errorf("keep the drain across restarts: %w", err)
		}
		return nil
	}
	if err := os.Remove(path); err != nil && !errors.Is(err, fs.ErrNotExist) {
		return fmt.Errorf("keep the undrain across restarts: %w", err)
	}
	return nil
}
