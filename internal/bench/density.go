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
	// Block is how many creates make one row of the per-block table (rate, CPU per
	// create, MemAvailable), so a rate that falls as the count grows shows. Default 500.
	Block int
	// MinAvailable stops the fill once the host's MemAvailable drops below it (bytes), so a
	// fill on a shared machine leaves room for the rest. Default 4 GiB; negative: no floor.
	MinAvailable int64
	// CPU, when set, measures the CPU per create of each block (node, helpers, sandboxes;
	// the held sandboxes' idle CPU included).
	CPU *CPUMeter
	// Slow is the command latency beyond which an answer counts as late. Default 1 s.
	Slow time.Duration
	// RoundConcurrency is how many commands of the round after the fill run at once.
	// Default 4 × Concurrency. Each answer's latency includes its wait for a CPU, so on a
	// small host a round wider than its CPUs measures the queue, not a sandbox.
	RoundConcurrency int
}

// DensityBlock is one block of creates of a fill.
type DensityBlock struct {
	// Held is how many sandboxes existed at the end of the block, Created how many the
	// block added, Time how long it took.
	Held    int           `json:"held"`
	Created int           `json:"created"`
	Time    time.Duration `json:"time"`
	Rate    float64       `json:"perSecond"`
	// CPU is the CPU per create over the block (nil when not measured).
	CPU *CPUCost `json:"cpu,omitempty"`
	// Host is the whole machine's CPU per create over the block (with CPU, when the
	// node runs on this machine): where it exceeds CPU's total, the difference went to
	// kernel threads and processes outside the node.
	Host         *HostCPUCost `json:"host,omitempty"`
	MemAvailable int64        `json:"memAvailable"`
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
	// Split is the growth per sandbox of the node's, data planes' and sandboxes' own
	// counters (nil without a CPU meter, which finds them).
	Split *MemSplit `json:"perSandboxSplit,omitempty"`
	// CreateTime is how long creating them took; KillErrors counts failed kills.
	CreateTime time.Duration  `json:"createTime"`
	Blocks     []DensityBlock `json:"blocks"`
	// Command is the latency of the command each held sandbox ran after the fill (all of
	// them, RoundConcurrency at a time); Late counts answers slower than Slow.
	Command          Summary       `json:"command"`
	RoundConcurrency int           `json:"roundConcurrency"`
	Late             int           `json:"late"`
	Slow             time.Duration `json:"slow"`
	KillErrors       int           `json:"killErrors"`
	KillError        string        `json:"killError,omitempty"` // the first failed kill
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
	if o.Block <= 0 {
		o.Block = 500
	}
	if o.MinAvailable == 0 {
		o.MinAvailable = 4 << 30
	}
	if o.RoundConcurrency <= 0 {
		o.RoundConcurrency = 4 * o.Concurrency
	}
	if o.Slow <= 0 {
		o.Slow = time.Second
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
	var splitBefore MemSplit
	if o.CPU != nil {
		if splitBefore, err = readMemSplit(o.CPU); err != nil {
			return DensityResult{}, err
		}
	}
	r := DensityResult{Requested: o.Count, MemAvailableBefore: before, Slow: o.Slow, RoundConcurrency: o.RoundConcurrency}
	if warmKillErr != nil {
		r.KillErrors, r.KillError = 1, warmKillErr.Error()
	}

	created, err := fill(ctx, c, o, req, &r, splitBefore)
	n, kerr := killAll(context.WithoutCancel(ctx), c, created, o.Concurrency, func(d, t int) { progress("kill", d, t) })
	r.KillErrors += n
	if r.KillError == "" {
		r.KillError = kerr
	}
	return r, err
}

// fill creates the sandboxes and takes the measurements into r. It returns every sandbox
// it created, also on error, so the caller can kill them.
func fill(ctx context.Context, c *Client, o DensityOptions, req CreateRequest, r *DensityResult, splitBefore MemSplit) ([]Sandbox, error) {
	var (
		mu      sync.Mutex
		created []Sandbox
		stop    bool
		wg      sync.WaitGroup
		slots   = make(chan struct{}, o.Concurrency)
	)
	halt := func(why string) { // with mu held
		if !stop {
			stop, r.FirstError = true, why
		}
	}
	blocks := newBlockMeter(o)
	t0 := time.Now()
	for i := 0; i < o.Count; i++ {
		mu.Lock()
		done := stop || ctx.Err() != nil
		mu.Unlock()
		if done {
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
				halt(err.Error())
				return
			}
			created = append(created, sb)
			if why := blocks.created(len(created)); why != "" {
				halt(why)
			}
			if o.Progress != nil {
				o.Progress("create", len(created), o.Count)
			}
		}()
	}
	wg.Wait()
	r.CreateTime = time.Since(t0)
	r.Created = len(created)
	blocks.flush(len(created))
	r.Blocks = blocks.rows
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
	if o.CPU != nil {
		if a, err := readMemSplit(o.CPU); err == nil {
			s := a.perSandbox(splitBefore, r.Created)
			r.Split = &s
		}
	}
	if r.Created > 0 {
		r.PerSandbox = (r.MemAvailableBefore - r.MemAvailableAfter) / int64(r.Created)
	}
	lat := runAll(ctx, c, created, o.RoundConcurrency)
	r.Responsive = len(lat)
	r.Command = Summarize(lat)
	for _, d := range lat {
		if d > o.Slow {
			r.Late++
		}
	}
	return created, nil
}

// blockMeter cuts a fill into blocks of o.Block creates and watches the memory floor.
type blockMeter struct {
	o       DensityOptions
	rows    []DensityBlock
	t       time.Time
	cpu     CPUReading
	cpuOK   bool
	host    *hostCPU // nil: not read
	hostAt  hostReading
	held    int // at the start of the current block
	checked int // creates at the last MemAvailable check
}

func newBlockMeter(o DensityOptions) *blockMeter {
	b := &blockMeter{o: o, t: time.Now()}
	if o.CPU != nil {
		b.cpu, b.cpuOK = readCPU(o.CPU)
		if o.CPU.precise {
			skip := map[int]bool{o.CPU.src.NodePID: true, os.Getpid(): true}
			for _, pid := range o.CPU.src.DataPlanePIDs {
				skip[pid] = true
			}
			h := &hostCPU{procRoot: o.CPU.src.ProcRoot, skip: skip, cgroupParent: o.CPU.src.CgroupParent}
			if r, err := h.read(); err == nil {
				b.host, b.hostAt = h, r
			}
		}
	}
	return b
}

// memCheckEvery is how many creates pass between two readings of MemAvailable.
const memCheckEvery = 10

// created notes that n sandboxes exist; it closes a block every o.Block and returns why
// the fill must stop ("" to go on).
func (b *blockMeter) created(n int) string {
	if n%b.o.Block == 0 {
		b.flush(n)
	}
	if b.o.MinAvailable < 0 || n-b.checked < memCheckEvery {
		return ""
	}
	b.checked = n
	avail, err := MemAvailable(b.o.MemInfo)
	if err != nil {
		return err.Error()
	}
	if avail < b.o.MinAvailable {
		return fmt.Sprintf("host MemAvailable %s is below the floor of %s", mib(avail), mib(b.o.MinAvailable))
	}
	return ""
}

// flush closes the current block at n sandboxes held, if it added any.
func (b *blockMeter) flush(n int) {
	if n <= b.held {
		return
	}
	now := time.Now()
	row := DensityBlock{Held: n, Created: n - b.held, Time: now.Sub(b.t)}
	row.Rate = rate(row.Created, row.Time)
	if avail, err := MemAvailable(b.o.MemInfo); err == nil {
		row.MemAvailable = avail
	}
	if b.cpuOK {
		if cur, ok := readCPU(b.o.CPU); ok {
			row.CPU = costOf(cur.Sub(b.cpu), row.Created)
			b.cpu = cur
		}
	}
	if b.host != nil {
		if cur, err := b.host.read(); err == nil {
			row.Host = cur.costSince(b.hostAt, row.Created)
			if row.Host != nil {
				row.Host.TopOther, row.Host.TopOtherCPU = b.host.topOther(b.hostAt, cur, row.Created)
			}
			b.hostAt = cur
		}
	}
	b.rows = append(b.rows, row)
	b.t, b.held = now, n
}

func readCPU(m *CPUMeter) (CPUReading, bool) {
	r, err := m.Read()
	return r, err == nil
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

// runAll runs `true` in every sandbox, conc at a time, and returns the latencies of
// those that answered (exit code 0).
func runAll(ctx context.Context, c *Client, sbs []Sandbox, conc int) []time.Duration {
	var (
		mu  sync.Mutex
		lat []time.Duration
	)
	forEach(sbs, conc, func(sb Sandbox) {
		t := time.Now()
		res, err := c.Run(ctx, sb, "true")
		d := time.Since(t)
		if err == nil && res.ExitCode == 0 {
			mu.Lock()
			lat = append(lat, d)
			mu.Unlock()
		}
	})
	return lat
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
