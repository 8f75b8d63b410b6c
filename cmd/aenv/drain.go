package main

import (
	"context"
	"log/slog"

	"github.com/aenv-dev/aenv/internal/cluster/nodeagent"
	"github.com/aenv-dev/aenv/internal/orchestrator"
	"github.com/aenv-dev/aenv/internal/sandbox"
	"github.com/aenv-dev/aenv/internal/server"
)

// drainer drains the node (POST /aenv/drain): it heartbeats as draining at once, so the
// scheduler places nothing new here, then pauses every running sandbox to disk; with a
// repository each is published and resumes on another node through the gateway.
type drainer struct {
	report *nodeReport
	orch   *orchestrator.Orchestrator
	agent  *nodeagent.Agent
	log    *slog.Logger
}

func (d *drainer) Drain(ctx context.Context, draining bool) (server.DrainResult, error) {
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
