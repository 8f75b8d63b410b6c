package bench

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"strconv"
	"strings"
	"sync"
	"time"
)

// DensityOptions configures a density run.
type DensityOptions struct {
	Template string
	// Count is how many sandboxes to hold at once at most.
	Count int
	// Concurrency is how many creates are in flight at once. Default 4.
	Concurrency int
	// MemoryMB, when set, is each sandbox's memory limit (else the template's default).
	MemoryMB int
	// Settle is how long to wait after the last create before measuring host memory, so
	// the sandboxes' inits are idle. Default 3 s.
	Settle time.Duration
	// SandboxTimeout is each sandbox's TTL in seconds, a backstop for a crashed run. Default 600.
	SandboxTimeout int
	// MemInfo is the meminfo file read for MemAvailable. Default /proc/meminfo; it only
	// means something when the node runs on this host.
	MemInfo string
	// Progress, when set, is called as sandboxes are created (phase "create") and killed
	// (phase "kill").
	Progress func(phase string, done, total int)
}

// DensityResult is what a density run found.
type DensityResult struct {
	Requested int `json:"requested"`
	// Created is the ceiling: sandboxes that existed at once. FirstError is why creation
	// stopped short of Requested, if it did.
	Created    int    `json:"created"`
	FirstError string `json:"firstError,omitempty"`
	// Responsive is how many of them answered a command after all were created.
	Responsive int `json:"responsive"`
	// MemAvailable on the host before the first create and after the last (bytes), and the
	// difference per created sandbox.
	MemAvailableBefore int64 `json:"memAvailableBefore"`
	MemAvailableAfter  int64 `json:"memAvailableAfter"`
	PerSandbox         int64 `json:"perSandboxBytes"`
	// CreateTime is how long creating them took; KillErrors counts failed kills.
	CreateTime time.Duration `json:"createTime"`
	KillErrors int           `json:"killErrors"`
	KillError  string        `json:"killError,omitempty"` // the first failed kill
}

// RunDensity creates sandboxes until Count exist or the first create fails, checks that each
// answers a command, reads the host's MemAvailable before and after, and kills them all
// (also when ctx is cancelled).
func RunDensity(ctx context.Context, c *Client, o DensityOptions) (DensityResult, error) {
	if o.Count <= 0 {
		return DensityResult{}, fmt.Errorf("bench: count must be positive, got %d", o.Count)
	}
	if o.Concurrency <= 0 {
		o.Concurrency = 4
	}
	if o.Settle <= 0 {
		o.Settle = 3 * time.Second
	}
	if o.SandboxTimeout <= 0 {
		o.SandboxTimeout = 600
	}
	if o.MemInfo == "" {
		o.MemInfo = "/proc/meminfo"
	}
	progress := func(phase string, done, total int) {
		if o.Progress != nil {
			o.Progress(phase, done, total)
		}
	}
	req := CreateRequest{TemplateID: o.Template, Timeout: o.SandboxTimeout, Secure: true, MemoryMB: o.MemoryMB}

	// One sandbox first, unmeasured, so the node's warm pools are in their steady state
	// in both memory readings.
	warm, err := c.Create(ctx, req)
	if err != nil {
		return DensityResult{}, fmt.Errorf("bench: warm-up sandbox: %w", err)
	}
	// A failed kill is counted, not fatal: the density figures do not depend on it.
	warmKillErr := c.Kill(context.WithoutCancel(ctx), warm.ID)
	if err := sleepCtx(ctx, o.Settle); err != nil {
		return DensityResult{}, err
	}
	before, err := MemAvailable(o.MemInfo)
	if err != nil {
		return DensityResult{}, err
	}
	r := DensityResult{Requested: o.Count, MemAvailableBefore: before}
	if warmKillErr != nil {
		r.KillErrors, r.KillError = 1, warmKillErr.Error()
	}

	created, err := fill(ctx, c, o, req, &r)
	n, kerr := killAll(context.WithoutCancel(ctx), c, created, o.Concurrency, func(d, t int) { progress("kill", d, t) })
	r.KillErrors += n
	if r.KillError == "" {
		r.KillError = kerr
	}
	return r, err
}

// fill creates the sandboxes and takes the measurements into r. It returns every sandbox
// it created, also on error, so the caller can kill them.
func fill(ctx context.Context, c *Client, o DensityOptions, req CreateRequest, r *DensityResult) ([]Sandbox, error) {
	var (
		mu      sync.Mutex
		created []Sandbox
		stop    bool
		wg      sync.WaitGroup
		slots   = make(chan struct{}, o.Concurrency)
	)
	t0 := time.Now()
	for i := 0; i < o.Count; i++ {
		mu.Lock()
		halt := stop || ctx.Err() != nil
		mu.Unlock()
		if halt {
			break
		}
		slots <- struct{}{}
		wg.Add(1)
		go func() {
			defer func() { <-slots; wg.Done() }()
			sb, err := c.Create(ctx, req)
			mu.Lock()
			defer mu.Unlock()
			if err != nil {
				if !stop {
					stop, r.FirstError = true, err.Error()
				}
				return
			}
			created = append(created, sb)
			if o.Progress != nil {
				o.Progress("create", len(created), o.Count)
			}
		}()
	}
	wg.Wait()
	r.CreateTime = time.Since(t0)
	r.Created = len(created)
	if err := ctx.Err(); err != nil {
		return created, fmt.Errorf("bench: %w", err)
	}
	if err := sleepCtx(ctx, o.Settle); err != nil {
		return created, err
	}
	after, err := MemAvailable(o.MemInfo)
	if err != nil {
		return created, err
	}
	r.MemAvailableAfter = after
	if r.Created > 0 {
		r.PerSandbox = (r.MemAvailableBefore - r.MemAvailableAfter) / int64(r.Created)
	}
	r.Responsive = countResponsive(ctx, c, created, o.Concurrency)
	return created, nil
}

// sleepCtx waits d or until ctx ends.
func sleepCtx(ctx context.Context, d time.Duration) error {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-ctx.Done():
		return fmt.Errorf("bench: %w", ctx.Err())
	case <-t.C:
		return nil
	}
}

// countResponsive runs `true` in every sandbox and counts those that answered.
func countResponsive(ctx context.Context, c *Client, sbs []Sandbox, conc int) int {
	var (
		mu sync.Mutex
		n  int
	)
	forEach(sbs, conc, func(sb Sandbox) {
		res, err := c.Run(ctx, sb, "true")
		if err == nil && res.ExitCode == 0 {
			mu.Lock()
			n++
			mu.Unlock()
		}
	})
	return n
}

// killAll kills every sandbox and returns how many kills failed and the first failure.
func killAll(ctx context.Context, c *Client, sbs []Sandbox, conc int, progress func(done, total int)) (int, string) {
	var (
		mu         sync.Mutex
		done, errs int
		first      string
	)
	forEach(sbs, conc, func(sb Sandbox) {
		kctx, cancel := context.WithTimeout(ctx, time.Minute)
		err := c.Kill(kctx, sb.ID)
		cancel()
		mu.Lock()
		done++
		if err != nil {
			errs++
			if first == "" {
				first = err.Error()
			}
		}
		progress(done, len(sbs))
		mu.Unlock()
	})
	return errs, first
}

func forEach(sbs []Sandbox, conc int, f func(Sandbox)) {
	var wg sync.WaitGroup
	slots := make(chan struct{}, max(conc, 1))
	for _, sb := range sbs {
		slots <- struct{}{}
		wg.Add(1)
		go func() {
			defer func() { <-slots; wg.Done() }()
			f(sb)
		}()
	}
	wg.Wait()
}

// MemAvailable reads MemAvailable (in bytes) from a /proc/meminfo-format file.
func MemAvailable(path string) (int64, error) {
	f, err := os.Open(path)
	if err != nil {
		return 0, fmt.Errorf("bench: %w", err)
	}
	defer f.Close()
	v, err := parseMemAvailable(f)
	if err != nil {
		return 0, fmt.Errorf("bench: %s: %w", path, err)
	}
	return v, nil
}

var errNoMemAvailable = errors.New("no MemAvailable line")

func parseMemAvailable(r io.Reader) (int64, error) {
	sc := bufio.NewScanner(r)
	for sc.Scan() {
		rest, ok := strings.CutPrefix(sc.Text(), "MemAvailable:")
		if !ok {
			continue
		}
		f := strings.Fields(rest)
		if len(f) != 2 || f[1] != "kB" {
			return 0, fmt.Errorf("malformed MemAvailable line %q", sc.Text())
		}
		kb, err := strconv.ParseInt(f[0], 10, 64)
		if err != nil || kb < 0 {
			return 0, fmt.Errorf("malformed MemAvailable line %q", sc.Text())
		}
		return kb * 1024, nil
	}
	if err := sc.Err(); err != nil {
		return 0, err
	}
	return 0, errNoMemAvailable
}
