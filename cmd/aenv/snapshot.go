package main

import (
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"strconv"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/spf13/cobra"

	"github.com/aenv-dev/aenv/internal/server/api"
)

func newSnapshotCmd(g *globals) *cobra.Command {
	cmd := &cobra.Command{
		Use:   "snapshot",
		Short: "Snapshot sandboxes, list and delete snapshots",
		Long: "A snapshot pins a running sandbox's filesystem (the sandbox keeps running). Create\n" +
			"sandboxes from it with `aenv start SNAPSHOT` or the SDKs' Sandbox.create(SNAPSHOT), or\n" +
			"fork a sandbox directly with `aenv fork`.",
	}
	cmd.AddCommand(newSnapshotCreateCmd(g), newSnapshotListCmd(g), newSnapshotRemoveCmd(g))
	return cmd
}

func newSnapshotCreateCmd(g *globals) *cobra.Command {
	var name, output string
	cmd := &cobra.Command{
		Use:     "create SANDBOX",
		Short:   "Snapshot a running sandbox (it keeps running with the same ID)",
		Example: "  aenv snapshot create i4f2c0a1b --name step-3",
		Args:    cobra.ExactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			format, err := tableOrJSON(output)
			if err != nil {
				return err
			}
			c, err := g.client()
			if err != nil {
				return err
			}
			body := api.SandboxSnapshotRequest{}
			if name != "" {
				body.Name = &name
			}
			resp, err := c.api.CreateSandboxSnapshotWithResponse(cmd.Context(), args[0], body)
			if err != nil {
				return c.transportErr(err)
			}
			if resp.JSON201 == nil {
				return snapshotErr(c, "snapshot "+args[0], resp.StatusCode(), resp.Body)
			}
			if format == "json" {
				return encodeIndented(cmd.OutOrStdout(), resp.JSON201)
			}
			return printSnapshots(cmd.OutOrStdout(), []api.SnapshotInfo{*resp.JSON201})
		},
	}
	cmd.Flags().StringVar(&name, "name", "", "a unique name that resolves to the snapshot like a template name")
	cmd.Flags().StringVarP(&output, "output", "o", "", "table or json (default: table on a terminal, json otherwise)")
	return cmd
}

// snapshotErr adds to apiErr what the snapshot and fork answers mean.
func snapshotErr(c *client, what string, status int, body []byte) error {
	err := c.apiErr(what, status, body)
	switch status {
	case http.StatusNotImplemented:
		return fmt.Errorf("%w (this sandbox's template or backend cannot be snapshotted; see docs/getting-started.md)", err)
	case http.StatusConflict:
		return fmt.Errorf("%w (only running sandboxes can be snapshotted or forked)", err)
	}
	return err
}

// listSnapshots pages through GET /snapshots.
func (c *client) listSnapshots(cmd *cobra.Command, params api.ListSnapshotsParams) ([]api.SnapshotInfo, error) {
	return allPages(c, "list snapshots", func(next *string) (*[]api.SnapshotInfo, *http.Response, []byte, error) {
		params.NextToken = next
		resp, err := c.api.ListSnapshotsWithResponse(cmd.Context(), &params)
		if err != nil {
			return nil, nil, nil, err
		}
		return resp.JSON200, resp.HTTPResponse, resp.Body, nil
	})
}

func newSnapshotListCmd(g *globals) *cobra.Command {
	var sandboxID, name, output string
	cmd := &cobra.Command{
		Use:     "ls",
		Aliases: []string{"list"},
		Short:   "List snapshots (a table on a terminal, JSON when piped)",
		Args:    cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			format, err := tableOrJSON(output)
			if err != nil {
				return err
			}
			c, err := g.client()
			if err != nil {
				return err
			}
			params := api.ListSnapshotsParams{}
			if sandboxID != "" {
				params.SandboxID = &sandboxID
			}
			if name != "" {
				params.Name = &name
			}
			all, err := c.listSnapshots(cmd, params)
			if err != nil {
				return err
			}
			if format == "json" {
				return encodeIndented(cmd.OutOrStdout(), all)
			}
			return printSnapshots(cmd.OutOrStdout(), all)
		},
	}
	cmd.Flags().StringVar(&sandboxID, "sandbox", "", "only snapshots taken from this sandbox")
	cmd.Flags().StringVar(&name, "name", "", "only the snapshot with this name (or ID)")
	cmd.Flags().StringVarP(&output, "output", "o", "", "table or json (default: table on a terminal, json otherwise)")
	return cmd
}

func printSnapshots(w io.Writer, items []api.SnapshotInfo) error {
	tw := tabwriter.NewWriter(w, 0, 4, 2, ' ', 0)
	fmt.Fprintln(tw, "ID\tNAMES\tSOURCE SANDBOX\tPARENT\tCREATED")
	for _, s := range items {
		created := ""
		if s.CreatedAt != nil {
			created = s.CreatedAt.Local().Format("2006-01-02 15:04:05")
		}
		fmt.Fprintf(tw, "%s\t%s\t%s\t%s\t%s\n", s.SnapshotID, dashIfEmpty(strings.Join(s.Names, ",")),
			dashIfEmpty(strOrEmpty(s.SourceSandboxID)), dashIfEmpty(strOrEmpty(s.ParentID)), created)
	}
	return tw.Flush()
}

func strOrEmpty(s *string) string {
	if s == nil {
		return ""
	}
	return *s
}

func dashIfEmpty(s string) string {
	if s == "" {
		return "-"
	}
	return s
}

func newSnapshotRemoveCmd(g *globals) *cobra.Command {
	return &cobra.Command{
		Use:     "rm SNAPSHOT...",
		Aliases: []string{"delete"},
		Short:   "Delete snapshots by ID or name (sandboxes created from them keep running)",
		Args:    cobra.MinimumNArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			c, err := g.client()
			if err != nil {
				return err
			}
			for _, ref := range args {
				// DELETE /templates/{id} deletes templates too: make sure this is a snapshot,
				// so a typo never removes a template.
				found, err := c.listSnapshots(cmd, api.ListSnapshotsParams{Name: &ref})
				if err != nil {
					return err
				}
				if len(found) != 1 {
					return fmt.Errorf("no snapshot %q (`aenv snapshot ls` lists snapshots; templates are removed with `aenv template rm`)", ref)
				}
				id := found[0].SnapshotID
				resp, err := c.api.DeleteTemplateWithResponse(cmd.Context(), id)
				if err != nil {
					return c.transportErr(err)
				}
				if resp.StatusCode() != http.StatusNoContent && resp.StatusCode() != http.StatusOK {
					return c.apiErr("delete snapshot "+ref, resp.StatusCode(), resp.Body)
				}
				fmt.Fprintln(cmd.OutOrStdout(), "deleted snapshot", id)
			}
			return nil
		},
	}
}

// parseTimeoutSeconds reads a timeout given as seconds ("60") or a duration ("10m").
func parseTimeoutSeconds(s string) (int32, error) {
	if n, err := strconv.Atoi(s); err == nil {
		if n <= 0 {
			return 0, fmt.Errorf("--timeout %q must be positive", s)
		}
		s += "s"
	}
	d, err := time.ParseDuration(s)
	if err != nil {
		return 0, fmt.Errorf("--timeout %q: want seconds or a duration like 10m", s)
	}
	return durationSeconds(d)
}

// timeoutText is a --timeout in seconds or as a duration, checked when given and kept
// as written (parseTimeoutSeconds turns it into the API's seconds).
type timeoutText struct{ s *string }

func (t timeoutText) String() string {
	if t.s == nil {
		return ""
	}
	return *t.s
}

func (t timeoutText) Set(v string) error {
	if _, err := parseTimeoutSeconds(v); err != nil {
		return err
	}
	*t.s = v
	return nil
}

func (timeoutText) Type() string { return "duration" }

func newForkCmd(g *globals) *cobra.Command {
	var (
		count   int
		timeout string
		output  string
	)
	cmd := &cobra.Command{
		Use:   "fork SANDBOX",
		Short: "Fork a running sandbox into N copies (one snapshot, N new sandboxes)",
		Long: "fork snapshots the sandbox once and creates --count sandboxes from it concurrently; each\n" +
			"child has its own ID and writable filesystem. On the OCI backend children start fresh\n" +
			"processes on the copied filesystem. One line per child, in order: a table row on a\n" +
			"terminal, a JSON object per line (JSON lines) when piped or with -o json; the\n" +
			"exit status is 1 when any child failed.",
		Example: "  aenv fork i4f2c0a1b -n 16 --timeout 10m",
		Args:    cobra.ExactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			format, err := tableOrJSON(output)
			if err != nil {
				return err
			}
			if count < 1 || count > 100 {
				return fmt.Errorf("--count %d: want 1 to 100", count)
			}
			body := api.SandboxForkRequest{}
			n := int32(count)
			body.Count = &n
			if timeout != "" {
				secs, err := parseTimeoutSeconds(timeout)
				if err != nil {
					return err
				}
				body.Timeout = &secs
			}
			c, err := g.client()
			if err != nil {
				return err
			}
			resp, err := c.api.ForkSandboxWithResponse(cmd.Context(), args[0], body)
			if err != nil {
				return c.transportErr(err)
			}
			if resp.JSON201 == nil {
				return snapshotErr(c, "fork "+args[0], resp.StatusCode(), resp.Body)
			}
			results := *resp.JSON201
			if format == "json" {
				// One line per child, as the table: JSON lines.
				enc := json.NewEncoder(cmd.OutOrStdout())
				for _, r := range results {
					if err = enc.Encode(r); err != nil {
						break
					}
				}
			} else {
				err = printForks(cmd.OutOrStdout(), results)
			}
			if err != nil {
				return err
			}
			failed := 0
			for _, r := range results {
				if r.Sandbox == nil {
					failed++
				}
			}
			if failed > 0 {
				return fmt.Errorf("%d of %d forks of %s failed", failed, len(results), args[0])
			}
			return nil
		},
	}
	f := cmd.Flags()
	f.IntVarP(&count, "count", "n", 1, "number of children, 1 to 100")
	f.Var(timeoutText{&timeout}, "timeout", "time until each child expires: seconds (600) or a duration (10m) (default: the node's)")
	f.StringVarP(&output, "output", "o", "", "table or json (default: table on a terminal, json otherwise)")
	return cmd
}

func printForks(w io.Writer, results []api.SandboxForkResult) error {
	tw := tabwriter.NewWriter(w, 0, 4, 2, ' ', 0)
	fmt.Fprintln(tw, "#\tSANDBOX\tTEMPLATE\tERROR")
	for i, r := range results {
		switch {
		case r.Sandbox != nil:
			fmt.Fprintf(tw, "%d\t%s\t%s\t-\n", i, r.Sandbox.SandboxID, r.Sandbox.TemplateID)
		case r.Error != nil:
			fmt.Fprintf(tw, "%d\t-\t-\t%s (HTTP %d)\n", i, r.Error.Message, r.Error.Code)
		default:
			fmt.Fprintf(tw, "%d\t-\t-\tno result\n", i)
		}
	}
	return tw.Flush()
}
