package main

import (
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"text/tabwriter"
	"time"

	"github.com/spf13/cobra"

	"github.com/aenv-dev/aenv/internal/cluster/gateway"
	"github.com/aenv-dev/aenv/internal/server/api"
)

func newNodesCmd(g *globals) *cobra.Command {
	var output string
	cmd := &cobra.Command{
		Use:   "nodes",
		Short: "List a cluster's nodes with their state, capacity and load (ask the gateway: --url)",
		Args:  cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			output, err := tableOrJSON(output)
			if err != nil {
				return err
			}
			c, err := g.client()
			if err != nil {
				return err
			}
			req, err := http.NewRequestWithContext(cmd.Context(), http.MethodGet, c.base+"/nodes", nil)
			if err != nil {
				return err
			}
			req.Header.Set("X-API-Key", c.key)
			resp, err := c.http.Do(req)
			if err != nil {
				return c.transportErr(err)
			}
			defer resp.Body.Close()
			body, err := io.ReadAll(resp.Body)
			if err != nil {
				return c.transportErr(err)
			}
			if resp.StatusCode == http.StatusNotFound {
				return fmt.Errorf("%s has no /nodes: it is a lone node, not a cluster's gateway (point --url at `aenv gateway`)", c.base)
			}
			if resp.StatusCode != http.StatusOK {
				return c.apiErr("list nodes", resp.StatusCode, body)
			}
			var nodes []gateway.NodeStatus
			if err := json.Unmarshal(body, &nodes); err != nil {
				return fmt.Errorf("list nodes: the answer is not a node list: %w", err)
			}
			if output == "json" {
				enc := json.NewEncoder(cmd.OutOrStdout())
				enc.SetIndent("", "  ")
				return enc.Encode(nodes)
			}
			return printNodes(cmd.OutOrStdout(), nodes, time.Now())
		},
	}
	cmd.Flags().StringVarP(&output, "output", "o", "", "table or json (default: table on a terminal, JSON when piped)")
	cmd.AddCommand(newDrainCmd(g, true), newDrainCmd(g, false))
	return cmd
}

// newDrainCmd is `aenv nodes drain NODE` (no new placements; the node's running
// sandboxes are paused to disk and resume on other nodes) and `aenv nodes undrain NODE`.
func newDrainCmd(g *globals, draining bool) *cobra.Command {
	use, short := "drain NODE", "Drain a node: no new sandboxes; its running ones are paused to disk and resume on other nodes"
	action := "drain"
	if !draining {
		use, short, action = "undrain NODE", "Let a drained node take new sandboxes again", "undrain"
	}
	return &cobra.Command{
		Use:   use,
		Short: short,
		Args:  cobra.ExactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			c, err := g.client()
			if err != nil {
				return err
			}
			var res *api.DrainResult
			var status int
			var body []byte
			if draining {
				resp, err := c.api.DrainNodeWithResponse(cmd.Context(), args[0])
				if err != nil {
					return c.transportErr(err)
				}
				res, status, body = resp.JSON200, resp.StatusCode(), resp.Body
			} else {
				resp, err := c.api.UndrainNodeWithResponse(cmd.Context(), args[0])
				if err != nil {
					return c.transportErr(err)
				}
				res, status, body = resp.JSON200, resp.StatusCode(), resp.Body
			}
			if res == nil {
				return c.apiErr(action+" node "+args[0], status, body)
			}
			paused := res.Paused
			var failed map[string]string
			if res.Failed != nil {
				failed = *res.Failed
			}
			out := cmd.OutOrStdout()
			if !draining {
				fmt.Fprintf(out, "node %s takes new sandboxes again\n", args[0])
				return nil
			}
			fmt.Fprintf(out, "node %s is draining: %d sandboxes paused to disk (they resume on other nodes)\n", args[0], len(paused))
			for id, why := range failed {
				fmt.Fprintf(out, "  %s: not paused: %s\n", id, why)
			}
			if len(failed) > 0 {
				return fmt.Errorf("%d sandboxes of node %s could not be paused", len(failed), args[0])
			}
			return nil
		},
	}
}

func printNodes(w io.Writer, nodes []gateway.NodeStatus, now time.Time) error {
	tw := tabwriter.NewWriter(w, 0, 4, 2, ' ', 0)
	fmt.Fprintln(tw, "NODE\tSTATE\tBACKEND\tSANDBOXES\tCPU\tMEM MiB\tLAST SEEN\tENDPOINT")
	limit := func(used, capacity int64) string {
		if capacity == 0 {
			return fmt.Sprintf("%d/-", used)
		}
		return fmt.Sprintf("%d/%d", used, capacity)
	}
	for _, n := range nodes {
		fmt.Fprintf(tw, "%s\t%s\t%s\t%s\t%s\t%s\t%s ago\t%s\n", n.NodeID, n.State, n.Backend,
			limit(int64(n.Sandboxes), int64(n.Capacity.Sandboxes)),
			limit(int64(n.Allocated.CPUCount+n.Reserved.CPUCount), int64(n.Capacity.CPUCount)),
			limit(n.Allocated.MemoryMB+n.Reserved.MemoryMB, n.Capacity.MemoryMB),
			now.Sub(n.LastHeartbeat).Round(time.Second), n.Endpoint)
	}
	return tw.Flush()
}
