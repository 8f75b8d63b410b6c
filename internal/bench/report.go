package bench

import (
	"encoding/json"
	"fmt"
	"io"
	"slices"
	"text/tabwriter"
	"time"
)

// Combine merges repeated runs of one configuration: every percentile, the wall time and the
// rate are the median over the runs (the figures on a shared machine are noisy, a median
// of runs is steadier than any single one); counts are summed.
func Combine(runs []Result) Result {
	if len(runs) == 0 {
		return Result{}
	}
	out := Result{Mode: runs[0].Mode, Concurrency: runs[0].Concurrency}
	pick := func(f func(Result) time.Duration) time.Duration {
		v := make([]time.Duration, len(runs))
		for i, r := range runs {
			v[i] = f(r)
		}
		return Median(v)
	}
	median := func(f func(Result) Summary) Summary {
		return Summary{
			Min:  pick(func(r Result) time.Duration { return f(r).Min }),
			P50:  pick(func(r Result) time.Duration { return f(r).P50 }),
			P95:  pick(func(r Result) time.Duration { return f(r).P95 }),
			P99:  pick(func(r Result) time.Duration { return f(r).P99 }),
			Max:  pick(func(r Result) time.Duration { return f(r).Max }),
			Mean: pick(func(r Result) time.Duration { return f(r).Mean }),
		}
	}
	out.Total = median(func(r Result) Summary { return r.Total })
	out.Create = median(func(r Result) Summary { return r.Create })
	out.Command = median(func(r Result) Summary { return r.Command })
	out.Client = median(func(r Result) Summary { return r.Client })
	out.ClientCPU = pick(func(r Result) time.Duration { return r.ClientCPU })
	out.Wall = pick(func(r Result) time.Duration { return r.Wall })
	cpu, toAnswer := make([]*CPUCost, len(runs)), make([]*CPUCost, len(runs))
	for i, r := range runs {
		cpu[i], toAnswer[i] = r.CPU, r.CPUToAnswer
	}
	out.CPU, out.CPUToAnswer = medianCost(cpu), medianCost(toAnswer)
	rates := make([]float64, len(runs))
	for i, r := range runs {
		out.N += r.N
		out.Failures += r.Failures
		out.WarmupFailures += r.WarmupFailures
		out.Total.N, out.Create.N, out.Command.N = out.Total.N+r.Total.N, out.Create.N+r.Create.N, out.Command.N+r.Command.N
		out.Client.N += r.Client.N
		rates[i] = r.Rate
		for _, e := range r.Errors {
			out.Errors = addError(out.Errors, e)
		}
	}
	slices.Sort(rates)
	out.Rate = rates[(len(rates)-1)/2]
	return out
}

// CreateReport is the outcome of `aenv bench create`: every run, and per configuration the
// median over its repeats.
type CreateReport struct {
	Runs    [][]Result `json:"runs"`    // per configuration, each repeat
	Medians []Result   `json:"medians"` // per configuration, Combine of its repeats
}

// NewCreateReport combines the repeats of each configuration.
func NewCreateReport(runs [][]Result) CreateReport {
	r := CreateReport{Runs: runs}
	for _, rs := range runs {
		r.Medians = append(r.Medians, Combine(rs))
	}
	return r
}

// Write prints the report as a table ("table") or JSON ("json").
func (r CreateReport) Write(w io.Writer, format string) error {
	if format == "json" {
		return writeJSON(w, r)
	}
	tw := tabwriter.NewWriter(w, 0, 4, 2, ' ', tabwriter.AlignRight)
	fmt.Fprintln(tw, "path\tconc\truns\tn\tfail\tp50\tp95\tp99\tmax\tcreate p50\tcmd p50\tclient p50\tsbx/s\tcpu/sbx\tcpu→cmd\t")
	cpu, client := false, false
	for i, m := range r.Medians {
		fmt.Fprintf(tw, "%s\t%d\t%d\t%d\t%d\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%.1f\t%s\t%s\t\n",
			m.Mode, m.Concurrency, len(r.Runs[i]), m.N, m.Failures,
			ms(m.Total.P50), ms(m.Total.P95), ms(m.Total.P99), ms(m.Total.Max),
			ms(m.Create.P50), ms(m.Command.P50), optMs(m.Client), m.Rate, cpuMs(m.CPU), cpuMs(m.CPUToAnswer))
		cpu = cpu || m.CPU != nil
		client = client || m.Client.N > 0
	}
	if err := tw.Flush(); err != nil {
		return err
	}
	for _, m := range r.Medians {
		for _, e := range m.Errors {
			fmt.Fprintf(w, "%s c=%d failure: %s\n", m.Mode, m.Concurrency, e)
		}
	}
	if len(r.Runs) > 0 && len(r.Runs[0]) > 1 {
		fmt.Fprintln(w, "(percentiles are medians over the runs; create → first command completed)")
	}
	if client {
		fmt.Fprintln(w, "(client: the part of create → first command the client spent in its own code, no request")
		fmt.Fprintln(w, " outstanding; sequential runs only)")
		for _, m := range r.Medians {
			if m.ClientCPU > 0 {
				fmt.Fprintf(w, "%s c=%d client (node.js) cpu/sbx %s, not in cpu/sbx\n", m.Mode, m.Concurrency, ms(m.ClientCPU))
			}
		}
	}
	if cpu {
		fmt.Fprintln(w, "(cpu/sbx: node, its helpers and the sandboxes' cgroup per sandbox over the run, kill included;")
		fmt.Fprintln(w, " cpu→cmd: request → first command answered, sequential runs only)")
		for _, m := range r.Medians {
			if c := m.CPU; c != nil {
				fmt.Fprintf(w, "%s c=%d cpu/sbx %s = node %s + runtime %s + data plane %s + sandboxes %s\n", m.Mode, m.Concurrency,
					ms(c.Total), ms(c.Node), ms(c.Runtime), ms(c.DataPlane), ms(c.Sandboxes))
			}
		}
	}
	return nil
}

// Write prints the density result as a table ("table") or JSON ("json").
func (d DensityResult) Write(w io.Writer, format string) error {
	if format == "json" {
		return writeJSON(w, d)
	}
	tw := tabwriter.NewWriter(w, 0, 4, 2, ' ', 0)
	fmt.Fprintf(tw, "requested\t%d\n", d.Requested)
	fmt.Fprintf(tw, "ceiling (held at once)\t%d\n", d.Created)
	if d.FirstError != "" {
		fmt.Fprintf(tw, "stopped by\t%s\n", d.FirstError)
	}
	fmt.Fprintf(tw, "answered a command\t%d\n", d.Responsive)
	if d.Command.N > 0 {
		fmt.Fprintf(tw, "command latency\tp50 %s  p99 %s  max %s  (%d slower than %s; %d at once)\n",
			ms(d.Command.P50), ms(d.Command.P99), ms(d.Command.Max), d.Late, d.Slow, d.RoundConcurrency)
	}
	fmt.Fprintf(tw, "create time\t%s (%.1f sandboxes/s)\n", d.CreateTime.Round(time.Millisecond), rate(d.Created, d.CreateTime))
	fmt.Fprintf(tw, "host MemAvailable before\t%s\n", mib(d.MemAvailableBefore))
	fmt.Fprintf(tw, "host MemAvailable after\t%s\n", mib(d.MemAvailableAfter))
	fmt.Fprintf(tw, "per idle sandbox\t%s\n", mib(d.PerSandbox))
	if s := d.Split; s != nil {
		fmt.Fprintf(tw, "  of which counted\t%s: sandboxes' cgroup %s, data plane %s, node %s\n",
			mib(s.Total()), mib(s.Sandboxes), mib(s.DataPlane), mib(s.Node))
	}
	if d.KillErrors > 0 {
		fmt.Fprintf(tw, "failed kills\t%d (first: %s)\n", d.KillErrors, d.KillError)
	}
	if err := tw.Flush(); err != nil {
		return err
	}
	return writeBlocks(w, d.Blocks)
}

// writeBlocks prints a fill's blocks: the rate and the CPU per create as the count grows.
func writeBlocks(w io.Writer, blocks []DensityBlock) error {
	if len(blocks) == 0 {
		return nil
	}
	tw := tabwriter.NewWriter(w, 0, 4, 2, ' ', tabwriter.AlignRight)
	fmt.Fprintln(tw, "\nheld\tcreated\ttime\tcreates/s\tcpu/create\tnode\thelpers\tsandboxes\thost busy\tkernel threads\ttop other process\tMemAvailable\t")
	for _, b := range blocks {
		node, helpers, sbx := "-", "-", "-"
		if b.CPU != nil {
			node, helpers, sbx = ms(b.CPU.Node), ms(b.CPU.Helpers), ms(b.CPU.Sandboxes)
		}
		busy, kthreads, other := "-", "-", "-"
		if h := b.Host; h != nil {
			busy, kthreads = ms(h.Busy), ms(h.KernelThreads)
			if h.TopKernelThread != "" {
				kthreads += fmt.Sprintf(" (%s %s)", h.TopKernelThread, ms(h.TopKernelThreadCPU))
			}
			if h.TopOther != "" {
				other = fmt.Sprintf("%s %s", h.TopOther, ms(h.TopOtherCPU))
			}
		}
		fmt.Fprintf(tw, "%d\t%d\t%s\t%.1f\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t\n", b.Held, b.Created,
			b.Time.Round(time.Millisecond), b.Rate, cpuMs(b.CPU), node, helpers, sbx, busy, kthreads, other, mib(b.MemAvailable))
	}
	return tw.Flush()
}

// stage is one row of a latency table.
type stage struct {
	name string
	s    Summary
}

// writeStages prints a latency table with a row per stage, then "<failures> of <total>
// <failed>" and each failure.
func writeStages(w io.Writer, header string, rows []stage, failures, total int, failed string, errs []string) error {
	tw := tabwriter.NewWriter(w, 0, 4, 2, ' ', tabwriter.AlignRight)
	fmt.Fprintf(tw, "%s\tn\tp50\tp95\tmin\tmax\t\n", header)
	for _, r := range rows {
		fmt.Fprintf(tw, "%s\t%d\t%s\t%s\t%s\t%s\t\n", r.name, r.s.N, ms(r.s.P50), ms(r.s.P95), ms(r.s.Min), ms(r.s.Max))
	}
	if err := tw.Flush(); err != nil {
		return err
	}
	if failures > 0 {
		fmt.Fprintf(w, "%d of %d %s\n", failures, total, failed)
	}
	for _, e := range errs {
		fmt.Fprintf(w, "failure: %s\n", e)
	}
	return nil
}

func writeJSON(w io.Writer, v any) error {
	enc := json.NewEncoder(w)
	enc.SetIndent("", "  ")
	return enc.Encode(v)
}

func ms(d time.Duration) string { return fmt.Sprintf("%.1fms", float64(d)/float64(time.Millisecond)) }

func mib(b int64) string { return fmt.Sprintf("%.1f MiB", float64(b)/(1<<20)) }

func rate(n int, d time.Duration) float64 {
	if d <= 0 {
		return 0
	}
	return float64(n) / d.Seconds()
}

// optMs is s's p50, or "-" when nothing was measured.
func optMs(s Summary) string {
	if s.N == 0 {
		return "-"
	}
	return ms(s.P50)
}
