package bench

import (
	"context"
	"fmt"
	"io"
	"strconv"
	"strings"
	"time"
)

// PauseOptions configures `aenv bench pause`: pause one sandbox to disk and resume it, N
// times.
type PauseOptions struct {
	Template string
	// N is how many pause → resume cycles are measured, after Warmup unmeasured ones.
	N      int
	Warmup int
	// SandboxTimeout is the sandbox's TTL in seconds. Default 120.
	SandboxTimeout int
	// File is the path inside the sandbox each cycle writes and reads back. Default
	// /tmp/aenv-bench-pause.
	File string
	// KeepMemory pauses with {"memory": true}: a backend with memory snapshots (microvm)
	// keeps the sandbox's processes and memory. Default: pause to disk.
	KeepMemory bool
	// Progress, when set, is called after each measured cycle.
	Progress func(done, total int)
	// CPU, when set, measures the CPU the node's machine spends per pause and resume.
	CPU *CPUMeter
}

// PauseResult is what a pause run measured: Pause is POST pause {memory:false} until the
// node answers (filesystem captured, sandbox stopped); Resume is the connect that
// relaunches it until the node answers; Command the first command after it (which also
// checks that the file written before the pause is still there).
type PauseResult struct {
	N        int      `json:"n"`
	Failures int      `json:"failures"`
	Memory   bool     `json:"memory"` // paused with {"memory": true}
	Pause    Summary  `json:"pause"`
	Resume   Summary  `json:"resume"`
	Command  Summary  `json:"command"`
	Errors   []string `json:"errors,omitempty"`
	// CPU per operation (nil when not measured): the pause until the node answered; the
	// resume until the first command after it answered.
	CPUPause  *CPUCost `json:"cpuPause,omitempty"`
	CPUResume *CPUCost `json:"cpuResume,omitempty"`
}

// defaultPauseFile is where each cycle leaves its number, to be read back after the resume.
const defaultPauseFile = "/tmp/aenv-bench-pause"

// RunPause creates a sandbox from Template and cycles it through pause to disk and
// resume; before each pause it writes the cycle's number to a file, after each resume it
// reads it back (a mismatch is a failure). The sandbox is killed at the end. A failed
// pause or resume ends the run (the sandbox is then in no known state).
func RunPause(ctx context.Context, c *Client, o PauseOptions) (PauseResult, error) {
	if o.N < 1 || o.Warmup < 0 {
		return PauseResult{}, fmt.Errorf("bench: n (%d) must be positive, warmup (%d) not negative", o.N, o.Warmup)
	}
	if o.SandboxTimeout <= 0 {
		o.SandboxTimeout = 120
	}
	if o.File == "" {
		o.File = defaultPauseFile
	}
	sb, err := c.Create(ctx, CreateRequest{TemplateID: o.Template, Timeout: o.SandboxTimeout, Secure: true})
	if err != nil {
		return PauseResult{}, fmt.Errorf("bench: sandbox: %w", err)
	}
	defer func() { _ = killDetached(ctx, c, sb.ID) }()
	r := PauseResult{N: o.N, Memory: o.KeepMemory}
	var pauses, resumes, commands []time.Duration
	phases := newCPUPhases(o.CPU)
	for i := range o.Warmup + o.N {
		var ph *cpuPhases
		if i >= o.Warmup {
			ph = phases
		}
		s := pauseOnce(ctx, c, sb, i, o, ph)
		if ctx.Err() != nil {
			return PauseResult{}, fmt.Errorf("bench: %w", ctx.Err())
		}
		if s.fatal {
			return PauseResult{}, fmt.Errorf("bench: cycle %d: %w", i, s.err)
		}
		if i < o.Warmup {
			continue
		}
		if s.err != nil {
			r.Failures++
			r.Errors = addError(r.Errors, s.err.Error())
		} else {
			pauses, resumes, commands = append(pauses, s.pause), append(resumes, s.resume), append(commands, s.command)
		}
		if o.Progress != nil {
			o.Progress(i-o.Warmup+1, o.N)
		}
	}
	r.Pause, r.Resume, r.Command = Summarize(pauses), Summarize(resumes), Summarize(commands)
	r.CPUPause, r.CPUResume = phases.cost("pause", o.N), phases.cost("resume", o.N)
	return r, nil
}

type pauseSample struct {
	pause, resume, command time.Duration
	err                    error
	// fatal: the sandbox is in no state to go on (not running after the cycle).
	fatal bool
}

func pauseOnce(ctx context.Context, c *Client, sb Sandbox, cycle int, o PauseOptions, phases *cpuPhases) pauseSample {
	want := strconv.Itoa(cycle)
	if _, err := c.Run(ctx, sb, "printf %s "+want+" > "+o.File); err != nil {
		return pauseSample{err: err, fatal: true}
	}
	phases.start()
	t0 := time.Now()
	pause := c.PauseToDisk
	if o.KeepMemory {
		pause = c.PauseKeepingMemory
	}
	if err := pause(ctx, sb.ID); err != nil {
		return pauseSample{err: err, fatal: true}
	}
	t1 := time.Now()
	phases.mark("pause")
	if _, err := c.Connect(ctx, sb.ID, o.SandboxTimeout); err != nil {
		return pauseSample{err: err, fatal: true}
	}
	t2 := time.Now()
	res, err := c.Run(ctx, sb, "cat "+o.File)
	t3 := time.Now()
	phases.mark("resume")
	s := pauseSample{pause: t1.Sub(t0), resume: t2.Sub(t1), command: t3.Sub(t2), err: err}
	if err == nil && strings.TrimSpace(res.Stdout) != want {
		s.err = fmt.Errorf("after resume %s holds %q, want %q (exit %d: %s)", o.File, res.Stdout, want, res.ExitCode, res.Stderr)
	}
	return s
}

// Write prints the result as a table ("table") or JSON ("json").
func (r PauseResult) Write(w io.Writer, format string) error {
	if format == "json" {
		return writeJSON(w, r)
	}
	label := "pause to disk"
	if r.Memory {
		label = "pause (memory)"
	}
	if err := writeStages(w, "stage",
		[]stage{{label, r.Pause}, {"resume", r.Resume}, {"first command", r.Command}},
		r.Failures, r.N, "cycles failed", r.Errors); err != nil {
		return err
	}
	return writeCPU(w, []cpuRow{{label, r.CPUPause}, {"resume → first command", r.CPUResume}})
}
