package bench

import (
	"context"
	"fmt"
	"io"
	"time"
)

// SnapshotOptions configures `aenv bench snapshot`: snapshot one running sandbox and
// create a sandbox from each snapshot, N times.
type SnapshotOptions struct {
	Template string
	// N cycles are measured, after Warmup unmeasured ones.
	N      int
	Warmup int
	// Command is the first command in each sandbox created from a snapshot. Default "true".
	Command string
	// SandboxTimeout is the TTL (seconds) of every sandbox. Default 120.
	SandboxTimeout int
	// Progress, when set, is called after each measured cycle.
	Progress func(done, total int)
	// CPU, when set, measures the CPU the node's machine spends per snapshot and per
	// create from a snapshot.
	CPU *CPUMeter
}

// SnapshotResult is what a snapshot run measured. Snapshot is POST snapshots until the
// node answers (the source keeps running); Create the create from that snapshot until
// the node answers (on a backend with memory snapshots: a restore until envd in it has
// answered /init); Command the first command after it; Total Create + Command.
type SnapshotResult struct {
	N        int      `json:"n"`
	Failures int      `json:"failures"`
	Snapshot Summary  `json:"snapshot"`
	Create   Summary  `json:"create"`
	Command  Summary  `json:"command"`
	Total    Summary  `json:"total"`
	Errors   []string `json:"errors,omitempty"`
	// CPU per operation (nil when not measured): the snapshot until the node answered;
	// the create from it until its first command answered; the whole cycle, removing
	// the sandbox and the snapshot included.
	CPUSnapshot *CPUCost `json:"cpuSnapshot,omitempty"`
	CPUCreate   *CPUCost `json:"cpuCreate,omitempty"`
	CPUCycle    *CPUCost `json:"cpuCycle,omitempty"`
}

// RunSnapshot creates a source sandbox from Template, then per cycle snapshots it,
// creates a sandbox from the snapshot and runs Command in it; the new sandbox and the
// snapshot are removed after each cycle (not timed), the source at the end. A failed
// snapshot ends the run; a failed create or command is counted and the run goes on.
func RunSnapshot(ctx context.Context, c *Client, o SnapshotOptions) (SnapshotResult, error) {
	if o.N < 1 || o.Warmup < 0 {
		return SnapshotResult{}, fmt.Errorf("bench: n (%d) must be positive, warmup (%d) not negative", o.N, o.Warmup)
	}
	if o.Command == "" {
		o.Command = "true"
	}
	if o.SandboxTimeout <= 0 {
		o.SandboxTimeout = 120
	}
	src, err := c.Create(ctx, CreateRequest{TemplateID: o.Template, Timeout: o.SandboxTimeout, Secure: true})
	if err != nil {
		return SnapshotResult{}, fmt.Errorf("bench: source sandbox: %w", err)
	}
	defer func() { _ = killDetached(ctx, c, src.ID) }()
	if _, err := c.Run(ctx, src, o.Command); err != nil {
		return SnapshotResult{}, fmt.Errorf("bench: source sandbox: %w", err)
	}
	r := SnapshotResult{N: o.N}
	var snaps, creates, commands, totals []time.Duration
	var cpu *cpuWindow
	phases := newCPUPhases(o.CPU)
	for i := range o.Warmup + o.N {
		var ph *cpuPhases
		if i >= o.Warmup {
			ph = phases
		}
		if i == o.Warmup {
			cpu = beginCPU(ctx, o.CPU)
		}
		s := snapshotOnce(ctx, c, src.ID, o, ph)
		if ctx.Err() != nil {
			return SnapshotResult{}, fmt.Errorf("bench: %w", ctx.Err())
		}
		if s.fatal {
			return SnapshotResult{}, fmt.Errorf("bench: cycle %d: %w", i, s.err)
		}
		if i < o.Warmup {
			continue
		}
		if s.err != nil {
			r.Failures++
			r.Errors = addError(r.Errors, s.err.Error())
		} else {
			snaps, creates = append(snaps, s.snapshot), append(creates, s.create)
			commands, totals = append(commands, s.command), append(totals, s.create+s.command)
		}
		if o.Progress != nil {
			o.Progress(i-o.Warmup+1, o.N)
		}
	}
	r.Snapshot, r.Create, r.Command, r.Total = Summarize(snaps), Summarize(creates), Summarize(commands), Summarize(totals)
	r.CPUCycle = cpu.end(ctx, o.N)
	r.CPUSnapshot, r.CPUCreate = phases.cost("snapshot", o.N), phases.cost("create", o.N)
	return r, nil
}

type snapshotSample struct {
	snapshot, create, command time.Duration
	err                       error
	fatal                     bool // the source could not be snapshotted
}

func snapshotOnce(ctx context.Context, c *Client, src string, o SnapshotOptions, phases *cpuPhases) snapshotSample {
	phases.start()
	t0 := time.Now()
	snap, err := c.Snapshot(ctx, src)
	if err != nil {
		return snapshotSample{err: err, fatal: true}
	}
	s := snapshotSample{snapshot: time.Since(t0)}
	phases.mark("snapshot")
	defer func() {
		dctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), time.Minute)
		defer cancel()
		_ = c.DeleteTemplate(dctx, snap)
	}()
	t1 := time.Now()
	sb, err := c.Create(ctx, CreateRequest{TemplateID: snap, Timeout: o.SandboxTimeout, Secure: true})
	if err != nil {
		s.err = fmt.Errorf("create from snapshot: %w", err)
		return s
	}
	defer func() { _ = killDetached(ctx, c, sb.ID) }()
	t2 := time.Now()
	res, err := c.Run(ctx, sb, o.Command)
	s.create, s.command = t2.Sub(t1), time.Since(t2)
	phases.mark("create")
	if err == nil && res.ExitCode != 0 {
		err = fmt.Errorf("%q exited with %d: %s", o.Command, res.ExitCode, res.Stderr)
	}
	s.err = err
	return s
}

// Write prints the result as a table ("table") or JSON ("json").
func (r SnapshotResult) Write(w io.Writer, format string) error {
	if format == "json" {
		return writeJSON(w, r)
	}
	if err := writeStages(w, "stage",
		[]stage{{"snapshot", r.Snapshot}, {"create from snapshot", r.Create}, {"first command", r.Command},
			{"create → first command", r.Total}},
		r.Failures, r.N, "cycles failed", r.Errors); err != nil {
		return err
	}
	return writeCPU(w, []cpuRow{{"snapshot", r.CPUSnapshot}, {"create from snapshot → first command", r.CPUCreate},
		{"whole cycle (removals included)", r.CPUCycle}})
}
