package bench

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"io"
	"slices"
	"sync"
	"time"
)

// ForkOptions configures `aenv bench fork`: fork one running sandbox into Count children,
// Runs times.
type ForkOptions struct {
	Template string
	// Count is the children per fork; Runs how many forks are measured, after Warmup
	// unmeasured ones.
	Count  int
	Runs   int
	Warmup int
	// Command is each child's first command. Default "true".
	Command string
	// SandboxTimeout is the TTL (seconds) of the source and of every child. Default 120.
	SandboxTimeout int
	// PSS also measures what the idle children cost in host memory, once they have all
	// answered and then idled for Settle (default 3 s): the PSS of their processes on
	// this machine (SandboxPSS under ProcRoot, default /proc), meaningful only when the
	// node runs here.
	PSS      bool
	Settle   time.Duration
	ProcRoot string
	// Progress, when set, is called after each measured fork.
	Progress func(done, total int)
	// CPU, when set, measures the CPU the node's machine spends per child.
	CPU *CPUMeter
}

// IdleMemory is what a fork's idle children cost: the median over runs of their total
// PSS, against Children × their guest memory (GuestMB, 0 when the node did not say).
type IdleMemory struct {
	Children   int     `json:"children"`
	TotalPSS   int64   `json:"totalPSSBytes"`
	PerChild   int64   `json:"perChildPSSBytes"`
	GuestMB    int     `json:"guestMB"`
	Overcommit float64 `json:"overcommit"`
	// Processes is how many host processes the children had (in the median run).
	Processes int `json:"processes"`
}

// ForkResult is what a fork run measured. Each run is timed from the fork request to
// the moment every child has answered its first command (AllAnswered); Fork is the
// request alone (the node's answer lists the children once envd in each is
// initialised), Child each child's own request → command completed.
type ForkResult struct {
	Count       int     `json:"count"`
	Runs        int     `json:"runs"`
	Failures    int     `json:"failures"` // runs in which some child failed
	Fork        Summary `json:"fork"`
	AllAnswered Summary `json:"allAnswered"`
	Child       Summary `json:"child"`
	// Idle is set when the run measured PSS.
	Idle *IdleMemory `json:"idle,omitempty"`
	// CPU is the CPU per child over the measured forks, the children's kills included;
	// CPUToAnswer per child from the fork request until every child answered. Nil when
	// not measured.
	CPU         *CPUCost `json:"cpu,omitempty"`
	CPUToAnswer *CPUCost `json:"cpuToAnswer,omitempty"`
	Errors      []string `json:"errors,omitempty"`
}

// RunFork creates a source sandbox from Template, checks that it runs Command, then forks
// it Warmup+Runs times; every child runs Command and is killed afterwards (not timed),
// as is the source at the end.
func RunFork(ctx context.Context, c *Client, o ForkOptions) (ForkResult, error) {
	if o.Count < 1 || o.Runs < 1 || o.Warmup < 0 {
		return ForkResult{}, fmt.Errorf("bench: count (%d) and runs (%d) must be positive, warmup (%d) not negative", o.Count, o.Runs, o.Warmup)
	}
	if o.Command == "" {
		o.Command = "true"
	}
	if o.SandboxTimeout <= 0 {
		o.SandboxTimeout = 120
	}
	if o.Settle <= 0 {
		o.Settle = 3 * time.Second
	}
	if o.ProcRoot == "" {
		o.ProcRoot = "/proc"
	}
	src, err := c.Create(ctx, CreateRequest{TemplateID: o.Template, Timeout: o.SandboxTimeout, Secure: true})
	if err != nil {
		return ForkResult{}, fmt.Errorf("bench: source sandbox: %w", err)
	}
	defer func() { _ = killDetached(ctx, c, src.ID) }()
	if _, err := c.Run(ctx, src, o.Command); err != nil {
		return ForkResult{}, fmt.Errorf("bench: source sandbox: %w", err)
	}
	r := ForkResult{Count: o.Count, Runs: o.Runs}
	var forks, all, children []time.Duration
	var idle []IdleMemory
	var cpu *cpuWindow
	phases := newCPUPhases(o.CPU)
	for i := range o.Warmup + o.Runs {
		if i == o.Warmup {
			cpu = beginCPU(ctx, o.CPU)
		}
		var ph *cpuPhases
		if i >= o.Warmup {
			ph = phases
		}
		s := forkOnce(ctx, c, src.ID, o, ph)
		if ctx.Err() != nil {
			return ForkResult{}, fmt.Errorf("bench: %w", ctx.Err())
		}
		if i < o.Warmup {
			continue
		}
		if s.err != nil {
			r.Failures++
			r.Errors = addError(r.Errors, s.err.Error())
		} else {
			forks, all = append(forks, s.fork), append(all, s.all)
			children = append(children, s.children...)
			if s.idle != nil {
				idle = append(idle, *s.idle)
			}
		}
		if o.Progress != nil {
			o.Progress(i-o.Warmup+1, o.Runs)
		}
	}
	r.Fork, r.AllAnswered, r.Child = Summarize(forks), Summarize(all), Summarize(children)
	r.CPU, r.CPUToAnswer = cpu.end(ctx, o.Runs*o.Count), phases.cost("answer", o.Runs*o.Count)
	if len(idle) > 0 {
		slices.SortFunc(idle, func(a, b IdleMemory) int { return cmp.Compare(a.TotalPSS, b.TotalPSS) })
		m := idle[(len(idle)-1)/2]
		r.Idle = &m
	}
	return r, nil
}

type forkSample struct {
	fork, all time.Duration
	children  []time.Duration
	idle      *IdleMemory
	err       error
}

// idleMemory lets the children idle for o.Settle and sums their PSS.
func idleMemory(ctx context.Context, c *Client, ids []string, o ForkOptions) (*IdleMemory, error) {
	if err := sleepCtx(ctx, o.Settle); err != nil {
		return nil, err
	}
	m := &IdleMemory{Children: len(ids)}
	for _, id := range ids {
		pss, n, err := SandboxPSS(o.ProcRoot, id)
		if err != nil {
			return nil, err
		}
		if n == 0 {
			return nil, fmt.Errorf("no process of child %s under %s (is the node on this machine?)", id, o.ProcRoot)
		}
		m.TotalPSS += pss
		m.Processes += n
	}
	m.PerChild = m.TotalPSS / int64(len(ids))
	if mb, err := c.MemoryMB(ctx, ids[0]); err == nil && mb > 0 && m.TotalPSS > 0 {
		m.GuestMB = mb
		m.Overcommit = float64(int64(len(ids))*int64(mb)<<20) / float64(m.TotalPSS)
	}
	return m, nil
}

// forkOnce forks src into o.Count children, runs o.Command in each as soon as the fork
// answers, and kills them all; phases gets the CPU of fork → all answered as "answer".
func forkOnce(ctx context.Context, c *Client, src string, o ForkOptions, phases *cpuPhases) forkSample {
	phases.start()
	t0 := time.Now()
	res, err := c.Fork(ctx, src, o.Count, o.SandboxTimeout)
	s := forkSample{fork: time.Since(t0), err: err}
	var mu sync.Mutex
	var wg sync.WaitGroup
	var errs []error
	for _, ch := range res {
		if ch.Sandbox == nil {
			msg := "no sandbox and no error"
			if ch.Error != nil {
				msg = ch.Error.Message
			}
			errs = append(errs, fmt.Errorf("fork child: %s", msg))
			continue
		}
		wg.Add(1)
		go func(sb Sandbox) {
			defer wg.Done()
			res, err := c.Run(ctx, sb, o.Command)
			d := time.Since(t0)
			if err == nil && res.ExitCode != 0 {
				err = fmt.Errorf("%q in child %s exited with %d: %s", o.Command, sb.ID, res.ExitCode, res.Stderr)
			}
			mu.Lock()
			s.children = append(s.children, d)
			if err != nil {
				errs = append(errs, err)
			}
			mu.Unlock()
		}(*ch.Sandbox)
	}
	wg.Wait()
	s.all = time.Since(t0)
	phases.mark("answer")
	if o.PSS && len(errs) == 0 && err == nil {
		var ids []string
		for _, ch := range res {
			ids = append(ids, ch.Sandbox.ID)
		}
		var perr error
		if s.idle, perr = idleMemory(ctx, c, ids, o); perr != nil {
			errs = append(errs, fmt.Errorf("idle PSS: %w", perr))
		}
	}
	// Killed with a context of their own: an interrupted run must not leave children behind.
	kctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), time.Minute)
	defer cancel()
	for _, ch := range res {
		if ch.Sandbox == nil {
			continue
		}
		wg.Add(1)
		go func(id string) {
			defer wg.Done()
			if err := c.Kill(kctx, id); err != nil {
				mu.Lock()
				errs = append(errs, err)
				mu.Unlock()
			}
		}(ch.Sandbox.ID)
	}
	wg.Wait()
	s.err = errors.Join(append([]error{s.err}, errs...)...)
	return s
}

// Write prints the result as a table ("table") or JSON ("json").
func (r ForkResult) Write(w io.Writer, format string) error {
	if format == "json" {
		return writeJSON(w, r)
	}
	if err := writeStages(w, fmt.Sprintf("fork -n %d", r.Count),
		[]stage{{"all answered", r.AllAnswered}, {"fork answered", r.Fork}, {"each child", r.Child}},
		r.Failures, r.Runs, "runs had failures", r.Errors); err != nil {
		return err
	}
	if c := r.CPU; c != nil {
		fmt.Fprintf(w, "\ncpu per child: %s (node %s, runtime %s, data plane %s, sandboxes %s), of which fork → all answered %s\n",
			ms(c.Total), ms(c.Node), ms(c.Runtime), ms(c.DataPlane), ms(c.Sandboxes), cpuMs(r.CPUToAnswer))
	}
	if m := r.Idle; m != nil {
		_, err := fmt.Fprintf(w, "\nidle children (median run): PSS %s in total, %s each (%d processes); guest RAM %d × %d MiB: %.1fx overcommit\n",
			mib(m.TotalPSS), mib(m.PerChild), m.Processes, m.Children, m.GuestMB, m.Overcommit)
		return err
	}
	return nil
}
