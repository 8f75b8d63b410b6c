package main

import (
	"fmt"
	"io"
	"net/http"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/spf13/cobra"

	"github.com/aenv-dev/aenv/internal/server/api"
)

func newTemplateLsCmd(g *globals) *cobra.Command {
	var output string
	var showAll bool
	cmd := &cobra.Command{
		Use:     "ls",
		Aliases: []string{"list"},
		Short:   "List templates (a table on a terminal, JSON when piped)",
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
			params := api.ListTemplatesV2Params{}
			all, err := allPages(c, "list templates", func(next *string) (*[]api.Template, *http.Response, []byte, error) {
				params.NextToken = next
				resp, err := c.api.ListTemplatesV2WithResponse(cmd.Context(), &params)
				if err != nil {
					return nil, nil, nil, err
				}
				return resp.JSON200, resp.HTTPResponse, resp.Body, nil
			})
			if err != nil {
				return err
			}
			if !showAll {
				all = userTemplates(all)
			}
			if output == "json" {
				return encodeIndented(cmd.OutOrStdout(), all)
			}
			return printTemplates(cmd.OutOrStdout(), all)
		},
	}
	cmd.Flags().StringVarP(&output, "output", "o", "", "table or json (default: table on a terminal, json otherwise)")
	cmd.Flags().BoolVarP(&showAll, "all", "a", false, "also list the internal img-<digest> templates that pulled images are converted into")
	return cmd
}

// userTemplates leaves out the internal templates a node makes of pulled images
// (img-<digest>, unnamed): builds and pulls name their own templates.
func userTemplates(items []api.Template) []api.Template {
	out := items[:0:0]
	for _, t := range items {
		if strings.HasPrefix(t.TemplateID, "img-") && len(t.Aliases) == 0 {
			continue
		}
		out = append(out, t)
	}
	return out
}

func printTemplates(w io.Writer, items []api.Template) error {
	tw := tabwriter.NewWriter(w, 0, 4, 2, ' ', 0)
	fmt.Fprintln(tw, "ID\tNAMES\tSTATUS\tBUILDS\tCPU\tMEM MiB\tCREATED")
	for _, t := range items {
		fmt.Fprintf(tw, "%s\t%s\t%s\t%d\t%d\t%d\t%s\n", t.TemplateID, strings.Join(t.Aliases, ","), t.BuildStatus,
			t.BuildCount, t.CpuCount, t.MemoryMB, t.CreatedAt.Local().Format(time.DateTime))
	}
	return tw.Flush()
}

func newTemplateRmCmd(g *globals) *cobra.Command {
	return &cobra.Command{
		Use:   "rm TEMPLATE...",
		Short: "Delete templates (by ID or name); running sandboxes keep working",
		Args:  cobra.MinimumNArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			c, err := g.client()
			if err != nil {
				return err
			}
			for _, id := range args {
				resp, err := c.api.DeleteTemplateWithResponse(cmd.Context(), id)
				if err != nil {
					return c.transportErr(err)
				}
				if resp.StatusCode() != http.StatusNoContent {
					return c.apiErr("delete template "+id, resp.StatusCode(), resp.Body)
				}
				fmt.Fprintln(cmd.OutOrStdout(), id)
			}
			return nil
		},
	}
}

func newTemplateLogsCmd(g *globals) *cobra.Command {
	var follow bool
	cmd := &cobra.Command{
		Use:   "logs TEMPLATE [BUILD]",
		Short: "Print a template build's log (default: its latest build)",
		Args:  cobra.RangeArgs(1, 2),
		RunE: func(cmd *cobra.Command, args []string) error {
			c, err := g.client()
			if err != nil {
				return err
			}
			resp, err := c.api.GetTemplateWithResponse(cmd.Context(), args[0], &api.GetTemplateParams{})
			if err != nil {
				return c.transportErr(err)
			}
			if resp.JSON200 == nil {
				return c.apiErr("template "+args[0], resp.StatusCode(), resp.Body)
			}
			t := resp.JSON200
			bid := ""
			if len(args) == 2 {
				bid = args[1]
			} else if n := len(t.Builds); n > 0 {
				bid = t.Builds[n-1].BuildID
			}
			if bid == "" {
				return fmt.Errorf("template %s has no builds on this node (it was pulled or installed, not built)", args[0])
			}
			return followBuild(cmd.Context(), c, cmd.OutOrStdout(), t.TemplateID, bid, follow)
		},
	}
	cmd.Flags().BoolVarP(&follow, "follow", "f", false, "keep printing until the build ends")
	return cmd
}
