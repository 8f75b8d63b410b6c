package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net/url"
	"os"
	"slices"
	"time"

	"github.com/spf13/cobra"

	"github.com/aenv-dev/aenv/internal/bench"
)

// newBenchCmd is `aenv bench`: measurements of a running node from the outside, through the
// same REST and envd paths the SDKs use (and, with --sdk-script, through the JS SDK itself).
func newBenchCmd() *cobra.Command {
	root := &cobra.Command{
		Use:   "bench",
		Short: "Measure a running node: create → first command latency, density, fork, pause to disk",
		Long: "bench measures a running aenv node (from --url / $AENV_URL, key as for every client\n" +
			"command). Sandboxes it creates get a short TTL and are killed when it ends, also when\n" +
			"interrupted. Figures on a busy machine are noisy: use --repeat and read the medians.",
	}
	// resolve finds the node like every other client command (flags, env, login, admin.key).
	resolve := func(cmd *cobra.Command) (string, string, error) {
		g := &globals{}
		g.url, _ = cmd.Flags().GetString("url")
		g.apiKey, _ = cmd.Flags().GetString("api-key")
		return g.resolve()
	}

	var (
		cpuf          cpuFlags
		co            bench.CreateOptions
		conc          []int
		repeat        int
		sdkScript     string
		node          string
		createOut     string
		density       bench.DensityOptions
		densityOut    string
		densitySettle time.Duration
		densityFloor  int64
		densityCPU    cpuFlags
	)
	create := &cobra.Command{
		Use:   "create",
		Short: "Latency of create → first command completed, sequential and concurrent",
		Long: "create measures, per sandbox, POST /v2/sandboxes followed by `/bin/bash -l -c true`\n" +
			"through envd's process.Start via the node's proxy (what the SDKs' commands.run does),\n" +
			"until the command's end event; then kills the sandbox (not timed). With --sdk-script\n" +
			"the same is measured through the E2B JS SDK (test/e2e/bench.mjs, needs node and\n" +
			"`npm ci` in test/e2e). Sequential runs also give the client's own share of each sample\n" +
			"(client p50: no request outstanding), and SDK runs the script's own CPU per sandbox.",
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			f, err := tableOrJSON(createOut)
			if err != nil {
				return err
			}
			base, key, err := resolve(cmd)
			if err != nil {
				return err
			}
			if repeat < 1 {
				return fmt.Errorf("--repeat %d: want at least 1", repeat)
			}
			if len(conc) == 0 || slices.Min(conc) < 1 {
				return fmt.Errorf("--concurrency %v: want positive values", conc)
			}
			if co.Gap < 0 || (co.Gap > 0 && sdkScript != "") {
				return fmt.Errorf("--gap %v: want a positive duration, and no --sdk-script (its runs take none)", co.Gap)
			}
			if co.Hold && sdkScript != "" {
				return errors.New("--hold: REST runs only (the SDK script kills each sandbox after its command); drop --sdk-script")
			}
			co.CPU, err = cpuf.meter(cmd, base)
			if err != nil {
				return err
			}
			c := bench.NewClient(base, key, slices.Max(conc))
			defer c.Close()
			prog := bench.NewProgress(cmd.ErrOrStderr(), isTerminal(os.Stderr))
			defer prog.Done()
			var runs [][]bench.Result
			for _, n := range conc {
				var rest, sdk []bench.Result
				for i := range repeat {
					o := co
					o.Concurrency = n
					prog.Label(fmt.Sprintf("rest c=%d run %d/%d", n, i+1, repeat))
					o.Progress = prog.Update
					r, err := bench.RunCreate(cmd.Context(), c, o)
					if err != nil {
						return err
					}
					rest = append(rest, r)
					if sdkScript == "" {
						continue
					}
					prog.Label(fmt.Sprintf("sdk c=%d run %d/%d", n, i+1, repeat))
					prog.Update(0, o.N)
					o.Progress = nil
					r, err = bench.RunSDK(cmd.Context(), bench.SDKOptions{Script: sdkScript, Node: node, URL: base, APIKey: key, CreateOptions: o})
					if err != nil {
						if cmd.Context().Err() != nil {
							return err
						}
						// One failed SDK run must not void the others: report it and go on.
						prog.Done()
						fmt.Fprintf(cmd.ErrOrStderr(), "aenv: SDK run c=%d %d/%d failed: %v\n", n, i+1, repeat, err)
						continue
					}
					sdk = append(sdk, r)
				}
				runs = append(runs, rest)
				if sdk != nil {
					runs = append(runs, sdk)
				}
			}
			prog.Done()
			return bench.NewCreateReport(runs).Write(cmd.OutOrStdout(), f)
		},
	}
	cf := create.Flags()
	cf.StringVar(&co.Template, "template", "base", "template to create sandboxes from")
	cf.IntVarP(&co.N, "n", "n", 50, "sandboxes measured per run")
	cf.IntSliceVar(&conc, "concurrency", []int{1, 16}, "sandboxes in flight at once; one run per value")
	cf.IntVar(&repeat, "repeat", 1, "runs per concurrency; percentiles are reported as medians over them")
	cf.IntVar(&co.Warmup, "warmup", 2, "unmeasured sandboxes before each run (fills the node's warm pools)")
	cf.StringVar(&co.Command, "command", "true", "the first command")
	cf.DurationVar(&co.Gap, "gap", 0, "pause after each sandbox's kill (REST runs): the node's refill and teardown run between sandboxes, so cpu→cmd is the request's own")
	cf.BoolVar(&co.Hold, "hold", false, "keep each run's sandboxes until all of them answered, then kill them (a batch of rollouts); by default each is killed after its command, beside the run's other creates")
	cf.StringVar(&sdkScript, "sdk-script", "", "also measure through the E2B JS SDK with this script (test/e2e/bench.mjs)")
	cf.StringVar(&node, "node", "node", "node binary for --sdk-script")
	cf.StringVarP(&createOut, "output", "o", "", "table or json (default: table on a terminal, json otherwise)")
	cpuf.add(create)

	dens := &cobra.Command{
		Use:   "density",
		Short: "How many idle sandboxes fit, and what each costs in host memory",
		Long: "density creates sandboxes until --count exist or the first create fails, checks that\n" +
			"each answers a command, reports the ceiling and the host's MemAvailable before and after\n" +
			"(meaningful only when the node runs on this machine), then kills them all. Every --block\n" +
			"creates it prints a row: the rate, the CPU per create (node, helpers, sandboxes; with\n" +
			"a local node also the whole machine's busy time and its kernel threads' share) and\n" +
			"MemAvailable, so a rate that falls as the count grows shows; it stops early once\n" +
			"MemAvailable drops below --min-available. The command round at the end gives the\n" +
			"latency percentiles across every held sandbox.",
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			f, err := tableOrJSON(densityOut)
			if err != nil {
				return err
			}
			base, key, err := resolve(cmd)
			if err != nil {
				return err
			}
			if u, err := url.Parse(base); err == nil && !localHost(u.Hostname()) {
				fmt.Fprintf(cmd.ErrOrStderr(), "aenv: %s is not on this machine: the memory figures are this machine's, not the node's\n", base)
			}
			o := density
			o.Settle = densitySettle
			o.MinAvailable = densityFloor << 20
			if densityFloor == 0 {
				o.MinAvailable = -1
			}
			if o.CPU, err = densityCPU.meter(cmd, base); err != nil {
				return err
			}
			c := bench.NewClient(base, key, 4*density.Concurrency)
			defer c.Close()
			prog := bench.NewProgress(cmd.ErrOrStderr(), isTerminal(os.Stderr))
			defer prog.Done()
			o.Progress = func(phase string, done, total int) {
				prog.Label(phase)
				prog.Update(done, total)
			}
			r, err := bench.RunDensity(cmd.Context(), c, o)
			prog.Done()
			if err != nil && r.Created == 0 {
				return err
			}
			// An interrupted fill still reports the blocks it measured.
			return errors.Join(r.Write(cmd.OutOrStdout(), f), err)
		},
	}
	df := dens.Flags()
	df.StringVar(&density.Template, "template", "base", "template to create sandboxes from")
	df.IntVar(&density.Count, "count", 200, "sandboxes to hold at once at most")
	df.IntVar(&density.Concurrency, "concurrency", 4, "creates in flight at once")
	df.IntVar(&density.MemoryMB, "memory", 0, "memory limit per sandbox in MiB (default: the template's)")
	df.DurationVar(&densitySettle, "settle", 3*time.Second, "wait before each memory reading")
	df.IntVar(&density.Block, "block", 500, "creates per row of the table of rate and CPU per create")
	df.Int64Var(&densityFloor, "min-available", 4096, "stop creating once the host's MemAvailable is below this many MiB (0: no floor)")
	df.DurationVar(&density.Slow, "slow", time.Second, "a command answer slower than this counts as late")
	df.IntVar(&density.RoundConcurrency, "round-concurrency", 0, "commands in flight at once in the round after the fill (default 4 × --concurrency)")
	df.IntVar(&density.SandboxTimeout, "ttl", 600, "each sandbox's timeout in seconds, a backstop for a crashed run; a fill slower than count/ttl per second loses its first sandboxes to it")
	densityCPU.add(dens)
	df.StringVarP(&densityOut, "output", "o", "", "table or json (default: table on a terminal, json otherwise)")

	root.AddCommand(create, dens, newBenchForkCmd(resolve), newBenchPauseCmd(resolve), newBenchSnapshotCmd(resolve))
	return root
}

// benchResult is a measurement that prints itself as a table or JSON.
type benchResult interface {
	Write(w io.Writer, format string) error
}

// runBench resolves the node, runs one measurement with conns connections under a
// progress display labelled label (and the CPU meter cpuf asks for), and writes its
// result as --output asks.
func runBench(cmd *cobra.Command, resolve func(*cobra.Command) (string, string, error), out, label string, conns int, cpuf *cpuFlags,
	run func(ctx context.Context, c *bench.Client, cpu *bench.CPUMeter, progress func(done, total int)) (benchResult, error)) error {
	f, err := tableOrJSON(out)
	if err != nil {
		return err
	}
	base, key, err := resolve(cmd)
	if err != nil {
		return err
	}
	meter, err := cpuf.meter(cmd, base)
	if err != nil {
		return err
	}
	c := bench.NewClient(base, key, conns)
	defer c.Close()
	prog := bench.NewProgress(cmd.ErrOrStderr(), isTerminal(os.Stderr))
	defer prog.Done()
	prog.Label(label)
	r, err := run(cmd.Context(), c, meter, prog.Update)
	prog.Done()
	if err != nil {
		return err
	}
	return r.Write(cmd.OutOrStdout(), f)
}

// newBenchForkCmd is `aenv bench fork`: fork → every child answered a command.
func newBenchForkCmd(resolve func(*cobra.Command) (string, string, error)) *cobra.Command {
	var (
		o    bench.ForkOptions
		out  string
		cpuf cpuFlags
	)
	cmd := &cobra.Command{
		Use:   "fork",
		Short: "Latency of fork -n N → every child answered a command",
		Long: "fork creates one sandbox from --template, then forks it --runs times into -n children\n" +
			"(after --warmup unmeasured forks). Each run is timed from POST /sandboxes/{id}/fork until\n" +
			"every child has completed its first command through envd; children are killed after\n" +
			"each run (not timed).",
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			return runBench(cmd, resolve, out, fmt.Sprintf("fork -n %d", o.Count), o.Count+1, &cpuf,
				func(ctx context.Context, c *bench.Client, cpu *bench.CPUMeter, progress func(done, total int)) (benchResult, error) {
					o.Progress, o.CPU = progress, cpu
					return bench.RunFork(ctx, c, o)
				})
		},
	}
	fl := cmd.Flags()
	fl.StringVar(&o.Template, "template", "base", "template of the source sandbox (must be layered to fork)")
	fl.IntVarP(&o.Count, "n", "n", 16, "children per fork")
	fl.IntVar(&o.Runs, "runs", 5, "forks measured")
	fl.IntVar(&o.Warmup, "warmup", 1, "unmeasured forks first")
	fl.StringVar(&o.Command, "command", "true", "each child's first command")
	fl.BoolVar(&o.PSS, "pss", false, "also report the idle children's PSS on this machine against their guest RAM (node on this machine)")
	fl.DurationVar(&o.Settle, "settle", 3*time.Second, "with --pss: idle time before the reading")
	fl.StringVarP(&out, "output", "o", "", "table or json (default: table on a terminal, json otherwise)")
	cpuf.add(cmd)
	return cmd
}

// newBenchSnapshotCmd is `aenv bench snapshot`: snapshot latency and create from a
// snapshot → first command.
func newBenchSnapshotCmd(resolve func(*cobra.Command) (string, string, error)) *cobra.Command {
	var (
		o    bench.SnapshotOptions
		out  string
		cpuf cpuFlags
	)
	cmd := &cobra.Command{
		Use:   "snapshot",
		Short: "Latency of snapshot, and of create from a snapshot → first command",
		Long: "snapshot creates one sandbox from --template and cycles -n times: snapshot it (timed\n" +
			"until the node answers), create a sandbox from the snapshot (timed until the node\n" +
			"answers: on microvm a restore until envd in it answered), run --command in it (timed);\n" +
			"the new sandbox and the snapshot are removed after each cycle (not timed).",
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			return runBench(cmd, resolve, out, "snapshot → create", 2, &cpuf,
				func(ctx context.Context, c *bench.Client, cpu *bench.CPUMeter, progress func(done, total int)) (benchResult, error) {
					o.Progress, o.CPU = progress, cpu
					return bench.RunSnapshot(ctx, c, o)
				})
		},
	}
	fl := cmd.Flags()
	fl.StringVar(&o.Template, "template", "base", "template of the source sandbox (must be layered to snapshot)")
	fl.IntVarP(&o.N, "n", "n", 10, "cycles measured")
	fl.IntVar(&o.Warmup, "warmup", 1, "unmeasured cycles first")
	fl.StringVar(&o.Command, "command", "true", "the first command in each sandbox created from a snapshot")
	fl.StringVarP(&out, "output", "o", "", "table or json (default: table on a terminal, json otherwise)")
	cpuf.add(cmd)
	return cmd
}

// newBenchPauseCmd is `aenv bench pause`: pause to disk and resume latency.
func newBenchPauseCmd(resolve func(*cobra.Command) (string, string, error)) *cobra.Command {
	var (
		o    bench.PauseOptions
		out  string
		cpuf cpuFlags
	)
	cmd := &cobra.Command{
		Use:   "pause",
		Short: "Latency of pause to disk and of resume",
		Long: "pause creates one sandbox from --template and cycles it -n times: write a file, pause\n" +
			"with memory:false, or true with --memory (timed until the node answers), connect (resume, timed until the node\n" +
			"answers), then read the file back through envd (timed; a changed file is a failure).",
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			return runBench(cmd, resolve, out, "pause/resume", 2, &cpuf,
				func(ctx context.Context, c *bench.Client, cpu *bench.CPUMeter, progress func(done, total int)) (benchResult, error) {
					o.Progress, o.CPU = progress, cpu
					return bench.RunPause(ctx, c, o)
				})
		},
	}
	fl := cmd.Flags()
	fl.StringVar(&o.Template, "template", "base", "template of the sandbox (must be layered to pause to disk)")
	fl.IntVarP(&o.N, "n", "n", 20, "pause → resume cycles measured")
	fl.IntVar(&o.Warmup, "warmup", 2, "unmeasured cycles first")
	fl.BoolVar(&o.KeepMemory, "memory", false, "pause with memory (microvm keeps processes) instead of to disk")
	fl.StringVarP(&out, "output", "o", "", "table or json (default: table on a terminal, json otherwise)")
	cpuf.add(cmd)
	return cmd
}
