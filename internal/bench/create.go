package bench

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"sync"
	"sync/atomic"
	"time"
)

// CreateOptions configures one create → first command measurement.
type CreateOptions struct {
	Template string
	// N is how many sandboxes are measured; Concurrency how many are in flight at once.
	N           int
	Concurrency int
	// Warmup sandboxes are created, used and killed first, unmeasured, so the node's warm
	// pools for the template are filled as they are in steady state.
	Warmup int
	// Command is what runs as the first command. Default "true".
	Command string
	// SandboxTimeout is the TTL given to each sandbox (seconds), so one a crashed benchmark
	// leaves behind expires by itself. Default 120.
	SandboxTimeout int
	// Progress, when set, is called after each measured sandbox.
	Progress func(done, total int)
	// CPU, when set, measures the CPU the node's machine spends per sandbox.
	CPU *CPUMeter
}

// maxErrors bounds how many distinct failure messages a Result keeps.
const maxErrors = 5

// addError appends msg to errs unless errs already holds it or holds maxErrors messages.
func addError(errs []string, msg string) []string {
	if len(errs) < maxErrors && !slices.Contains(errs, msg) {
		errs = append(errs, msg)
	}
	return errs
}

// killDetached kills sandbox id with a context of its own: an interrupted run must not
// leave sandboxes behind.
func killDetached(ctx context.Context, c *Client, id string) error {
	kctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), time.Minute)
	defer cancel()
	return c.Kill(kctx, id)
}

// Result is one measurement run.
type Result struct {
	Mode        string `json:"mode"` // "rest" (this client) or "sdk" (the E2B JS SDK script)
	Concurrency int    `json:"concurrency"`
	N           int    `json:"n"`
	Failures    int    `json:"failures"`
	// Total is create → first command completed; Create and Command are its two parts.
	Total   Summary `json:"total"`
	Create  Summary `json:"create"`
	Command Summary `json:"command"`
	// Wall is the run's duration; Rate the successful sandboxes per second over it.
	Wall   time.Duration `json:"wall"`
	Rate   float64       `json:"ratePerSec"`
	Errors []string      `json:"errors,omitempty"`
	// WarmupFailures counts unmeasured warm-up sandboxes that failed.
	WarmupFailures int `json:"warmupFailures,omitempty"`
	// CPU is the CPU per sandbox over the whole run: create, first command, kill and
	// what the node did in the background meanwhile (refilling warm pools).
	// CPUToAnswer, measured in sequential runs only, is request → first command
	// answered. Both are nil when not measured.
	CPU         *CPUCost `json:"cpu,omitempty"`
	CPUToAnswer *CPUCost `json:"cpuToAnswer,omitempty"`
}

// sample is one sandbox's measurement.
type sample struct {
	create, command time.Duration
	err             error
}

// RunCreate measures create → first command completed on the node c talks to: each
// sandbox is created with POST /v2/sandboxes, runs Command through envd, and is killed
// (the kill is not timed). It fails only when it cannot measure at all; failed sandboxes
// are counted in Result.Failures.
func RunCreate(ctx context.Context, c *Client, o CreateOptions) (Result, error) {
	if o.N <= 0 || o.Concurrency <= 0 {
		return Result{}, fmt.Errorf("bench: n (%d) and concurrency (%d) must be positive", o.N, o.Concurrency)
	}
	if o.Command == "" {
		o.Command = "true"
	}
	if o.SandboxTimeout <= 0 {
		o.SandboxTimeout = 120
	}
	// Warm-up failures are tolerated (three tries per warm-up sandbox): they are not
	// measured, and one bad sandbox must not void a run. They are kept in the result.
	var warmErrs []string
	for ok, tries := 0, 0; ok < o.Warmup; tries++ {
		if tries >= 3*o.Warmup {
			return Result{}, fmt.Errorf("bench: warm-up: %d sandboxes failed, the last: %s", tries, warmErrs[len(warmErrs)-1])
		}
		if s := createAndRun(ctx, c, o, nil); s.err != nil {
			warmErrs = append(warmErrs, s.err.Error())
		} else {
			ok++
		}
	}
	samples := make([]sample, o.N)
	var next, done atomic.Int64
	var wg sync.WaitGroup
	cpu := beginCPU(ctx, o.CPU)
	var phases *cpuPhases
	if o.Concurrency == 1 {
		phases = newCPUPhases(o.CPU)
	}
	start := time.Now()
	for range min(o.Concurrency, o.N) {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for {
				i := int(next.Add(1)) - 1
				if i >= o.N || ctx.Err() != nil {
					return
				}
				samples[i] = createAndRun(ctx, c, o, phases)
				if o.Progress != nil {
					o.Progress(int(done.Add(1)), o.N)
				}
			}
		}()
	}
	wg.Wait()
	wall := time.Since(start)
	if err := ctx.Err(); err != nil {
		return Result{}, fmt.Errorf("bench: %w", err)
	}
	r := summarizeRun("rest", o.Concurrency, samples, wall)
	r.CPU, r.CPUToAnswer = cpu.end(ctx, o.N), phases.cost("answer", o.N)
	r.WarmupFailures = len(warmErrs)
	for _, e := range warmErrs {
		if len(r.Errors) < maxErrors {
			r.Errors = append(r.Errors, "warm-up: "+e)
		}
	}
	return r, nil
}

// createAndRun measures one sandbox and kills it; phases (sequential runs) gets the CPU
// of request → first command answered as "answer".
func createAndRun(ctx context.Context, c *Client, o CreateOptions, phases *cpuPhases) sample {
	phases.start()
	t0 := time.Now()
	sb, err := c.Create(ctx, CreateRequest{TemplateID: o.Template, Timeout: o.SandboxTimeout, Secure: true})
	if err != nil {
		return sample{err: err}
	}
	t1 := time.Now()
	res, err := c.Run(ctx, sb, o.Command)
	t2 := time.Now()
	phases.mark("answer")
	if err == nil && res.ExitCode != 0 {
		err = fmt.Errorf("%q in %s exited with %d: %s", o.Command, sb.ID, res.ExitCode, res.Stderr)
	}
	if kerr := killDetached(ctx, c, sb.ID); kerr != nil {
		err = errors.Join(err, kerr)
	}
	return sample{create: t1.Sub(t0), command: t2.Sub(t1), err: err}
}

func summarizeRun(mode string, concurrency int, samples []sample, wall time.Duration) Result {
	r := Result{Mode: mode, Concurrency: concurrency, N: len(samples), Wall: wall}
	var total, create, command []time.Duration
	for _, s := range samples {
		if s.err != nil {
			r.Failures++
			r.Errors = addError(r.Errors, s.err.Error())
			continue
		}
		total = append(total, s.create+s.command)
		create = append(create, s.create)
		command = append(command, s.command)
	}
	r.Total, r.Create, r.Command = Summarize(total), Summarize(create), Summarize(command)
	if wall > 0 {
		r.Rate = float64(len(total)) / wall.Seconds()
	}
	return r
}
