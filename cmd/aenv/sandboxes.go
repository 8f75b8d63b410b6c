package main

import (
	"fmt"
	"io"
	"net/http"
	"os"
	"sort"
	"strconv"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/spf13/cobra"
	"golang.org/x/sys/unix"

	"github.com/aenv-dev/aenv/internal/server/api"
)

func newStartCmd(g *globals) *cobra.Command {
	var (
		timeout     time.Duration
		cpu, memory int
		envs, meta  []string
		detach      bool
	)
	cmd := &cobra.Command{
		Use:   "start [TEMPLATE]",
		Short: "Create a sandbox and attach a shell to it (-d: print its ID and return)",
		Example: "  aenv start                       # a shell in a new sandbox from the base template\n" +
			"  aenv start base -d --timeout 1h --env FOO=bar --metadata owner=me",
		Args: cobra.MaximumNArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			tpl := "base"
			if len(args) == 1 {
				tpl = args[0]
			}
			body := api.NewSandboxV2{TemplateID: tpl}
			if cmd.Flags().Changed("timeout") {
				secs, err := durationSeconds(timeout)
				if err != nil {
					return err
				}
				body.Timeout = &secs
			}
			if cpu != 0 {
				v := int32(cpu)
				body.CpuCount = &v
			}
			if memory != 0 {
				v := int32(memory)
				body.MemoryMB = &v
			}
			if len(envs) > 0 {
				m, err := parseKV("--env", envs)
				if err != nil {
					return err
				}
				ev := api.EnvVars(m)
				body.EnvVars = &ev
			}
			if len(meta) > 0 {
				m, err := parseKV("--metadata", meta)
				if err != nil {
					return err
				}
				md := api.SandboxMetadata(m)
				body.Metadata = &md
			}
			c, err := g.client()
			if err != nil {
				return err
			}
			resp, err := c.api.CreateSandboxV2WithResponse(cmd.Context(), body)
			if err != nil {
				return c.transportErr(err)
			}
			if resp.JSON201 == nil {
				return c.apiErr("create sandbox from "+strconv.Quote(tpl), resp.StatusCode(), resp.Body)
			}
			sb := resp.JSON201
			if detach {
				fmt.Fprintln(cmd.OutOrStdout(), sb.SandboxID)
				return nil
			}
			fmt.Fprintf(cmd.ErrOrStderr(), "sandbox %s started; attaching a shell (exit leaves it running)\n", sb.SandboxID)
			token := ""
			if sb.EnvdAccessToken != nil {
				token = *sb.EnvdAccessToken
			}
			err = c.envd(sb.SandboxID, token).shell(cmd.Context(), os.Stdin, cmd.OutOrStdout(), cmd.ErrOrStderr())
			fmt.Fprintf(cmd.ErrOrStderr(), "sandbox %s is still running: `aenv connect %[1]s` to return, `aenv kill %[1]s` to stop it\n", sb.SandboxID)
			return err
		},
	}
	f := cmd.Flags()
	f.DurationVar(&timeout, "timeout", 0, "time until the sandbox expires (e.g. 10m; default 5m)")
	f.IntVar(&cpu, "cpu", 0, "CPUs (default from the template)")
	f.IntVar(&memory, "memory", 0, "memory limit in MiB (default from the template)")
	f.StringArrayVar(&envs, "env", nil, "environment variable KEY=VALUE (repeatable)")
	f.StringArrayVar(&meta, "metadata", nil, "metadata KEY=VALUE (repeatable)")
	f.BoolVarP(&detach, "detach", "d", false, "print the sandbox ID instead of attaching a shell")
	return cmd
}

func durationSeconds(d time.Duration) (int32, error) {
	if d < time.Second || d > 24*time.Hour*365 {
		return 0, fmt.Errorf("--timeout %s must be at least 1s", d)
	}
	return int32((d + time.Second - 1) / time.Second), nil
}

func parseKV(flag string, in []string) (map[string]string, error) {
	out := make(map[string]string, len(in))
	for _, s := range in {
		k, v, ok := strings.Cut(s, "=")
		if !ok || k == "" {
			return nil, fmt.Errorf("%s %q: want KEY=VALUE", flag, s)
		}
		out[k] = v
	}
	return out, nil
}

// isTerminal reports whether f is a terminal.
func isTerminal(f *os.File) bool {
	// A character device is not enough: /dev/null is one (stdin of a script or a CI job).
	_, err := unix.IoctlGetTermios(int(f.Fd()), unix.TCGETS)
	return err == nil
}

// tableOrJSON resolves -o: table on a terminal, JSON when piped, unless asked.
func tableOrJSON(output string) (string, error) {
	if output == "" {
		output = "json"
		if isTerminal(os.Stdout) {
			output = "table"
		}
	}
	if output != "table" && output != "json" {
		return "", fmt.Errorf("-o %q: want table or json", output)
	}
	return output, nil
}

func newListCmd(g *globals) *cobra.Command {
	var (
		output string
		states []string
		meta   []string
	)
	cmd := &cobra.Command{
		Use:     "ls",
		Aliases: []string{"list"},
		Short:   "List sandboxes (a table on a terminal, JSON when piped)",
		Args:    cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			output, err := tableOrJSON(output)
			if err != nil {
				return err
			}
			c, err := g.client()
			if err != nil {
				return err
			}
			params := api.ListSandboxesV2Params{}
			if len(states) > 0 {
				st := make([]api.SandboxState, len(states))
				for i, s := range states {
					st[i] = api.SandboxState(s)
				}
				params.State = &st
			}
			if len(meta) > 0 {
				m, err := parseKV("--metadata", meta)
				if err != nil {
					return err
				}
				enc := encodeMetadataFilter(m)
				params.Metadata = &enc
			}
			all, err := allPages(c, "list sandboxes", func(next *string) (*[]api.ListedSandbox, *http.Response, []byte, error) {
				params.NextToken = next
				resp, err := c.api.ListSandboxesV2WithResponse(cmd.Context(), &params)
				if err != nil {
					return nil, nil, nil, err
				}
				return resp.JSON200, resp.HTTPResponse, resp.Body, nil
			})
			if err != nil {
				return err
			}
			if output == "json" {
				return encodeIndented(cmd.OutOrStdout(), all)
			}
			return printTable(cmd.OutOrStdout(), all)
		},
	}
	cmd.Flags().StringVarP(&output, "output", "o", "", "table or json (default: table on a terminal, json otherwise)")
	cmd.Flags().StringSliceVar(&states, "state", nil, "only these states: running, paused")
	cmd.Flags().StringArrayVar(&meta, "metadata", nil, "only sandboxes with metadata KEY=VALUE (repeatable)")
	return cmd
}

// encodeMetadataFilter encodes a metadata filter the way the E2B SDKs do (each key and value
// escaped, then joined as a query string, which the HTTP layer escapes once more).
func encodeMetadataFilter(m map[string]string) string {
	keys := make([]string, 0, len(m))
	for k := range m {
		keys = append(keys, k)
	}
	sort.Strings(keys)
	parts := make([]string, len(keys))
	for i, k := range keys {
		parts[i] = queryEscape(queryEscape(k)) + "=" + queryEscape(queryEscape(m[k]))
	}
	return strings.Join(parts, "&")
}

func printTable(w io.Writer, items []api.ListedSandbox) error {
	tw := tabwriter.NewWriter(w, 0, 4, 2, ' ', 0)
	fmt.Fprintln(tw, "ID\tTEMPLATE\tSTATE\tSTARTED\tEXPIRES IN\tCPU\tMEM MiB\tMETADATA")
	now := time.Now()
	for _, s := range items {
		md := ""
		if s.Metadata != nil {
			pairs := make([]string, 0, len(*s.Metadata))
			for k, v := range *s.Metadata {
				pairs = append(pairs, k+"="+v)
			}
			sort.Strings(pairs)
			md = strings.Join(pairs, ",")
		}
		fmt.Fprintf(tw, "%s\t%s\t%s\t%s\t%s\t%d\t%d\t%s\n", s.SandboxID, s.TemplateID, s.State,
			s.StartedAt.Local().Format("2006-01-02 15:04:05"), s.EndAt.Sub(now).Round(time.Second),
			s.CpuCount, s.MemoryMB, md)
	}
	return tw.Flush()
}

func newInfoCmd(g *globals) *cobra.Command {
	return &cobra.Command{
		Use:   "info SANDBOX",
		Short: "Show a sandbox's details as JSON",
		Args:  cobra.ExactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			c, err := g.client()
			if err != nil {
				return err
			}
			info, err := c.sandboxInfo(cmd.Context(), args[0])
			if err != nil {
				return err
			}
			return encodeIndented(cmd.OutOrStdout(), info)
		},
	}
}

func newPauseCmd(g *globals) *cobra.Command {
	var disk bool
	cmd := &cobra.Command{
		Use:   "pause SANDBOX",
		Short: "Pause a sandbox (resume it with `aenv resume` or `aenv connect`)",
		Long: "Pause a sandbox. By default its processes and memory are kept (frozen), so a resume\n" +
			"continues where it stopped. --disk snapshots its filesystem and stops it instead,\n" +
			"releasing CPU, memory, mounts and its network slot; a resume then restarts its\n" +
			"processes on the files as they were. Where the sandbox cannot be snapshotted (a\n" +
			"directory template), --disk pauses it in place.",
		Example: "  aenv pause sbx123          # keep processes and memory\n" +
			"  aenv pause sbx123 --disk   # free its resources; files survive, processes restart",
		Args: cobra.ExactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			c, err := g.client()
			if err != nil {
				return err
			}
			var body api.SandboxPauseRequest
			// Only --disk names memory: an empty body leaves the choice to the server's
			// default, as the SDKs' plain pause does.
			if disk {
				keep := false
				body.Memory = &keep
			}
			resp, err := c.api.PauseSandboxWithResponse(cmd.Context(), args[0], body)
			if err != nil {
				return c.transportErr(err)
			}
			if resp.StatusCode() != 204 {
				return c.apiErr("pause "+args[0], resp.StatusCode(), resp.Body)
			}
			if disk {
				fmt.Fprintln(cmd.OutOrStdout(), "paused to disk", args[0])
			} else {
				fmt.Fprintln(cmd.OutOrStdout(), "paused", args[0])
			}
			return nil
		},
	}
	cmd.Flags().BoolVar(&disk, "disk", false, "pause to disk: snapshot the filesystem and release CPU, memory, mounts and network")
	return cmd
}

func newResumeCmd(g *globals) *cobra.Command {
	var (
		timeout time.Duration
		cold    bool
	)
	cmd := &cobra.Command{
		Use:   "resume SANDBOX",
		Short: "Resume a paused sandbox (a running one just gets its expiry extended)",
		Long: "Resume a paused sandbox with the state it was paused with. --cold restarts its\n" +
			"processes on its filesystem as it was (a memory-paused sandbox is first captured to\n" +
			"disk), like the SDKs' onResume: \"reboot\"; where it cannot be captured, it resumes\n" +
			"with its memory.",
		Example: "  aenv resume sbx123 --timeout 1h\n" +
			"  aenv resume sbx123 --cold   # fresh processes, same files",
		Args: cobra.ExactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			c, err := g.client()
			if err != nil {
				return err
			}
			body := api.ConnectSandboxV2{}
			if cold {
				keep := false
				body.Memory = &keep
			}
			_, err = c.connect(cmd, cmd.OutOrStdout(), args[0], timeout, body)
			return err
		},
	}
	cmd.Flags().DurationVar(&timeout, "timeout", 5*time.Minute, "time until the sandbox expires")
	cmd.Flags().BoolVar(&cold, "cold", false, "restart the sandbox's processes on its filesystem instead of restoring its memory")
	return cmd
}

// connectSandbox is the v2 connect: resumes a paused sandbox, extends a running one.
func (c *client) connectSandbox(cmd *cobra.Command, id string, timeout time.Duration) (*api.Sandbox, error) {
	// Attaching prints the shell's output: that the sandbox was resumed is a note beside it.
	return c.connect(cmd, cmd.ErrOrStderr(), id, timeout, api.ConnectSandboxV2{})
}

// connect sends body (with timeout's seconds) to the v2 connect of id and, when that
// resumed it, says so on w.
func (c *client) connect(cmd *cobra.Command, w io.Writer, id string, timeout time.Duration, body api.ConnectSandboxV2) (*api.Sandbox, error) {
	secs, err := durationSeconds(timeout)
	if err != nil {
		return nil, err
	}
	body.Timeout = &secs
	resp, err := c.api.ConnectSandboxV2WithResponse(cmd.Context(), id, body)
	if err != nil {
		return nil, c.transportErr(err)
	}
	switch {
	case resp.JSON201 != nil:
		fmt.Fprintln(w, "resumed", id)
		return resp.JSON201, nil
	case resp.JSON200 != nil:
		return resp.JSON200, nil
	}
	return nil, c.apiErr("connect to "+id, resp.StatusCode(), resp.Body)
}

func newTimeoutCmd(g *globals) *cobra.Command {
	return &cobra.Command{
		Use:     "timeout SANDBOX DURATION",
		Short:   "Set a sandbox to expire DURATION from now (may shorten it)",
		Example: "  aenv timeout sbx123 30m",
		Args:    cobra.ExactArgs(2),
		RunE: func(cmd *cobra.Command, args []string) error {
			d, err := time.ParseDuration(args[1])
			if err != nil {
				n, nerr := strconv.Atoi(args[1])
				if nerr != nil {
					return fmt.Errorf("duration %q: want e.g. 30m, 1h or a number of seconds", args[1])
				}
				d = time.Duration(n) * time.Second
			}
			secs, err := durationSeconds(d)
			if err != nil {
				return err
			}
			c, err := g.client()
			if err != nil {
				return err
			}
			resp, err := c.api.SetSandboxTimeoutWithResponse(cmd.Context(), args[0], api.SandboxTimeoutRequest{Timeout: secs})
			if err != nil {
				return c.transportErr(err)
			}
			if resp.StatusCode() != 204 {
				return c.apiErr("set the timeout of "+args[0], resp.StatusCode(), resp.Body)
			}
			return nil
		},
	}
}

func newKillCmd(g *globals) *cobra.Command {
	return &cobra.Command{
		Use:     "kill SANDBOX...",
		Aliases: []string{"rm"},
		Short:   "Kill sandboxes (paused ones are deleted)",
		Args:    cobra.MinimumNArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			c, err := g.client()
			if err != nil {
				return err
			}
			var failed []error
			for _, id := range args {
				resp, err := c.api.KillSandboxWithResponse(cmd.Context(), id)
				if err != nil {
					return c.transportErr(err)
				}
				if resp.StatusCode() != 204 {
					failed = append(failed, c.apiErr("kill "+id, resp.StatusCode(), resp.Body))
					continue
				}
				fmt.Fprintln(cmd.OutOrStdout(), "killed", id)
			}
			if len(failed) > 0 {
				msgs := make([]string, len(failed))
				for i, e := range failed {
					msgs[i] = e.Error()
				}
				return fmt.Errorf("%s", strings.Join(msgs, "; "))
			}
			return nil
		},
	}
}
