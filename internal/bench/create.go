package bench

import (
	"context"
	"errors"
	"fmt"
	"net/http/httptrace"
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
	// Gap is how long each worker waits after a sandbox's kill before its next create
	// (REST runs): the node's background work (the warm pool's refill, the kill's
	// teardown) then runs between sandboxes rather than during the next one, so a
	// sequential run's CPUToAnswer is the request's own. Rate and Wall count the gaps.
	Gap time.Duration
	// Hold keeps every sandbox of a run until all of them have answered, then kills them
	// (not timed), as a batch of rollouts does: without it each is killed after its
	// command, and those kills run beside the run's other creates.
	Hold bool
	// Progress, when set, is called after each measured sandbox.
	Progress func(done, total int)
	// CPU, when set, measures the CPU the node's machine spends per sandbox.
	CPU *CPUMeter
}

// heldSandboxes collects a Hold run's sandboxes, for killAll once the run is measured.
type heldSandboxes struct {
	mu  sync.Mutex
	sbs []Sandbox
}

func (h *heldSandboxes) add(sb Sandbox) {
	h.mu.Lock()
	h.sbs = append(h.sbs, sb)
	h.mu.Unlock()
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
	// Client is the part of Total the client spent in its own code with no request
	// outstanding: before the create request went out, between the create's answer and
	// the command's request, and after the command's stream ended. Sequential runs only.
	Client Summary `json:"client"`
	// ClientCPU is the SDK script's own CPU (node.js) per measured sandbox, kill included;
	// SDK runs only. It is not in CPU, which counts the node's side.
	ClientCPU time.Duration `json:"clientCpu,omitempty"`
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

// sample is one sandbox's measurement; client 0: not measured.
type sample struct {
	create, command, client time.Duration
	err                     error
}

// RunCreate measures create → first command completed on the node c talks to: each
// sandbox is created with POST /v2/sandboxes, runs Command through envd, and is killed
// (the kill is not timed). It fails only when it cannot measure at all; failed sandboxes
// are counted in Result.Failures.
func RunCreate(ctx context.Context, c *Client, o CreateOptions) (Result, error) {
	if o.N <= 0 || o.Concurrency <= 0 {
		return Result{}, fmt.Errorf("bench: n (%d) and concurrency (%d) must be positive", o.N, o.Concurrency)
	}
	if o.Gap < 0 {
		return Result{}, fmt.Errorf("bench: negative gap %v", o.Gap)
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
		if s := createAndRun(ctx, c, o, nil, nil); s.err != nil {
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
	var (
		held heldSandboxes
		keep func(Sandbox)
	)
	if o.Hold {
		keep = held.add
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
				samples[i] = createAndRun(ctx, c, o, phases, keep)
				if o.Progress != nil {
					o.Progress(int(done.Add(1)), o.N)
				}
				if o.Gap > 0 && i < o.N-1 {
					select {
					case <-ctx.Done():
					case <-time.After(o.Gap):
					}
				}
			}
		}()
	}
	wg.Wait()
	wall := time.Since(start)
	_, kerr := killAll(context.WithoutCancel(ctx), c, held.sbs, o.Concurrency, func(int, int) {})
	if err := ctx.Err(); err != nil {
		return Result{}, fmt.Errorf("bench: %w", err)
	}
	r := summarizeRun("rest", o.Concurrency, samples, wall)
	if kerr != "" {
		r.Errors = addError(r.Errors, "kill: "+kerr)
	}
	r.CPU, r.CPUToAnswer = cpu.end(ctx, o.N), phases.cost("answer", o.N)
	r.WarmupFailures = len(warmErrs)
	for _, e := range warmErrs {
		if len(r.Errors) < maxErrors {
			r.Errors = append(r.Errors, "warm-up: "+e)
		}
	}
	return r, nil
}

// createAndRun measures one sandbox and kills it, or hands it to keep when set; phases
// (sequential runs) gets the CPU of request → first command answered as "answer".
func createAndRun(ctx context.Context, c *Client, o CreateOptions, phases *cpuPhases, keep func(Sandbox)) sample {
	phases.start()
	var hm httpMarks
	if o.Concurrency == 1 {
		ctx = hm.trace(ctx)
	}
	t0 := time.Now()
	sb, err := c.Create(ctx, CreateRequest{TemplateID: o.Template, Timeout: o.SandboxTimeout, Secure: true})
	if err != nil {
		return sample{err: err}
	}
	hm.next()
	t1 := time.Now()
	res, err := c.Run(ctx, sb, o.Command)
	t2 := time.Now()
	phases.mark("answer")
	if err == nil && res.ExitCode != 0 {
		err = fmt.Errorf("%q in %s exited with %d: %s", o.Command, sb.ID, res.ExitCode, res.Stderr)
	}
	if keep != nil {
		keep(sb)
	} else if kerr := killDetached(ctx, c, sb.ID); kerr != nil {
		err = errors.Join(err, kerr)
	}
	return sample{create: t1.Sub(t0), command: t2.Sub(t1), client: hm.client(t0), err: err}
}

// httpMarks records when the create's and the command's requests went out and when their
// answers began (net/http/httptrace), for the client's share of a sample: the REST
// client's counterpart of the SDK script's clientMs. The command's stream ends when Run
// has the end event, so nothing follows it here.
type httpMarks struct {
	mu       sync.Mutex
	on       bool
	i        int          // 0: the create, 1: the command
	sent     [2]time.Time // request written
	answered [2]time.Time // first byte of the answer
}

func (m *httpMarks) trace(ctx context.Context) context.Context {
	m.on = true
	return httptrace.WithClientTrace(ctx, &httptrace.ClientTrace{
		WroteRequest:         func(httptrace.WroteRequestInfo) { m.set(&m.sent) },
		GotFirstResponseByte: func() { m.set(&m.answered) },
	})
}

func (m *httpMarks) set(at *[2]time.Time) {
	m.mu.Lock()
	defer m.mu.Unlock()
	if at[m.i].IsZero() {
		at[m.i] = time.Now()
	}
}

// next moves on to the command's request.
func (m *httpMarks) next() {
	m.mu.Lock()
	m.i = 1
	m.mu.Unlock()
}

// client is the time before the create's request and between its answer and the
// command's request; 0 when not traced or a mark is missing.
func (m *httpMarks) client(t0 time.Time) time.Duration {
	m.mu.Lock()
	defer m.mu.Unlock()
	if !m.on || m.sent[0].IsZero() || m.answered[0].IsZero() || m.sent[1].IsZero() {
		return 0
	}
	return m.sent[0].Sub(t0) + m.sent[1].Sub(m.answered[0])
}

func summarizeRun(mode string, concurrency int, samples []sample, wall time.Duration) Result {
	r := Result{Mode: mode, Concurrency: concurrency, N: len(samples), Wall: wall}
	var total, create, command, client []time.Duration
	for _, s := range samples {
		if s.err != nil {
			r.Failures++
			r.Errors = addError(r.Errors, s.err.Error())
			continue
		}
		total = append(total, s.create+s.command)
		create = append(create, s.create)
		command = append(command, s.command)
		if s.client > 0 {
			client = append(client, s.client)
		}
	}
	r.Total, r.Create, r.Command = Summarize(total), Summarize(create), Summarize(command)
	r.Client = Summarize(client)
	if wall > 0 {
		r.Rate = float64(len(total)) / wall.Seconds()
	}
	return r
}
