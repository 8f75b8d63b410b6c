package main

import (
	"context"
	"net/http"
	"strings"
	"time"

	"github.com/spf13/cobra"

	"github.com/aenv-dev/aenv/internal/server/api"
)

// Shell completion (`aenv completion bash|zsh|fish|powershell`, cobra's) asks the node
// for the names an argument takes: sandbox IDs and template names. A node that does not
// answer within a second completes nothing rather than hang the shell.

const completeTimeout = time.Second

// completeSandboxes completes SANDBOX arguments with the node's sandbox IDs (each with
// its template as the description); many allows the argument at every position.
func completeSandboxes(g *globals, many bool) cobra.CompletionFunc {
	return func(cmd *cobra.Command, args []string, toComplete string) ([]cobra.Completion, cobra.ShellCompDirective) {
		if len(args) > 0 && !many {
			return nil, cobra.ShellCompDirectiveNoFileComp
		}
		c, err := g.client()
		if err != nil {
			return nil, cobra.ShellCompDirectiveNoFileComp | cobra.ShellCompDirectiveError
		}
		ctx, cancel := context.WithTimeout(cmd.Context(), completeTimeout)
		defer cancel()
		params := api.ListSandboxesV2Params{}
		all, err := allPages(c, "list sandboxes", func(next *string) (*[]api.ListedSandbox, *http.Response, []byte, error) {
			params.NextToken = next
			resp, err := c.api.ListSandboxesV2WithResponse(ctx, &params)
			if err != nil {
				return nil, nil, nil, err
			}
			return resp.JSON200, resp.HTTPResponse, resp.Body, nil
		})
		if err != nil {
			return nil, cobra.ShellCompDirectiveNoFileComp | cobra.ShellCompDirectiveError
		}
		var out []cobra.Completion
		for _, s := range all {
			if strings.HasPrefix(s.SandboxID, toComplete) {
				out = append(out, cobra.CompletionWithDesc(s.SandboxID, string(s.State)+" "+s.TemplateID))
			}
		}
		return out, cobra.ShellCompDirectiveNoFileComp
	}
}

// completeTemplates completes TEMPLATE arguments with the node's template names (IDs
// of unnamed ones), leaving out the img-<digest> imports as `aenv template ls` does.
func completeTemplates(g *globals, many bool) cobra.CompletionFunc {
	return func(cmd *cobra.Command, args []string, toComplete string) ([]cobra.Completion, cobra.ShellCompDirective) {
		if len(args) > 0 && !many {
			return nil, cobra.ShellCompDirectiveNoFileComp
		}
		c, err := g.client()
		if err != nil {
			return nil, cobra.ShellCompDirectiveNoFileComp | cobra.ShellCompDirectiveError
		}
		ctx, cancel := context.WithTimeout(cmd.Context(), completeTimeout)
		defer cancel()
		params := api.ListTemplatesV2Params{}
		all, err := allPages(c, "list templates", func(next *string) (*[]api.Template, *http.Response, []byte, error) {
			params.NextToken = next
			resp, err := c.api.ListTemplatesV2WithResponse(ctx, &params)
			if err != nil {
				return nil, nil, nil, err
			}
			return resp.JSON200, resp.HTTPResponse, resp.Body, nil
		})
		if err != nil {
			return nil, cobra.ShellCompDirectiveNoFileComp | cobra.ShellCompDirectiveError
		}
		var out []cobra.Completion
		for _, t := range userTemplates(all) {
			names := t.Aliases
			if len(names) == 0 {
				names = []string{t.TemplateID}
			}
			for _, n := range names {
				if strings.HasPrefix(n, toComplete) {
					out = append(out, cobra.CompletionWithDesc(n, string(t.BuildStatus)))
				}
			}
		}
		return out, cobra.ShellCompDirectiveNoFileComp
	}
}

// addCompletions wires the argument completions into the command tree.
func addCompletions(root *cobra.Command, g *globals) {
	for _, c := range root.Commands() {
		addCompletions(c, g)
	}
	use := root.Use
	switch {
	case strings.Contains(use, " SANDBOX..."):
		root.ValidArgsFunction = completeSandboxes(g, true)
	case strings.Contains(use, " SANDBOX"):
		root.ValidArgsFunction = completeSandboxes(g, false)
	case strings.Contains(use, " TEMPLATE..."):
		root.ValidArgsFunction = completeTemplates(g, true)
	case strings.Contains(use, " TEMPLATE") || strings.Contains(use, " [TEMPLATE]"):
		root.ValidArgsFunction = completeTemplates(g, false)
	}
}
