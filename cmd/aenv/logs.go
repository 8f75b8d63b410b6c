package main

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"slices"
	"strings"
	"time"

	"github.com/spf13/cobra"

	"github.com/aenv-dev/aenv/internal/server/api"
)

// errSandboxGone ends a follow whose sandbox was killed or expired.
var errSandboxGone = errors.New("sandbox is gone")

// logsOpts selects what readLogs fetches.
type logsOpts struct {
	since    time.Time // zero: from the oldest entry kept
	level    string    // "" = all
	follow   bool
	interval time.Duration // between polls when following
	pageSize int32         // entries per request (the node returns at most 1000)
}

func newLogsCmd(g *globals) *cobra.Command {
	var (
		follow bool
		since  time.Duration
		level  string
		output string
	)
	cmd := &cobra.Command{
		Use:   "logs SANDBOX",
		Short: "Print a sandbox's logs: its start command's output and lifecycle events",
		Long: "Print the logs a node keeps for a sandbox (running or paused): the template start\n" +
			"command's stdout (info) and stderr (warn) and the node's lifecycle events, oldest\n" +
			"first. On a terminal each entry is a line `timestamp level message [fields]`; piped\n" +
			"(or with -o json) each is a JSON object on its own line. --follow keeps polling for\n" +
			"new entries until interrupted or the sandbox goes.",
		Example: "  aenv logs sbx123\n" +
			"  aenv logs sbx123 -f --since 10m\n" +
			"  aenv logs sbx123 --level warn -o json | jq .message",
		Args: cobra.ExactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			output, err := tableOrJSON(output)
			if err != nil {
				return err
			}
			if level != "" && !slices.Contains([]string{"debug", "info", "warn", "error"}, level) {
				return fmt.Errorf("--level %q: want info, warn or error (or debug)", level)
			}
			if since < 0 {
				return fmt.Errorf("--since %s: want a positive duration such as 10m", since)
			}
			c, err := g.client()
			if err != nil {
				return err
			}
			opts := logsOpts{level: level, follow: follow, interval: time.Second, pageSize: 1000}
			if since > 0 {
				opts.since = time.Now().Add(-since)
			}
			w := cmd.OutOrStdout()
			err = c.readLogs(cmd.Context(), args[0], opts, func(e api.SandboxLogEntry) error {
				if output == "json" {
					return json.NewEncoder(w).Encode(e)
				}
				_, err := io.WriteString(w, formatLogLine(e))
				return err
			})
			switch {
			case errors.Is(err, errSandboxGone):
				fmt.Fprintf(cmd.ErrOrStderr(), "sandbox %s is gone (killed or expired)\n", args[0])
				return nil
			case errors.Is(err, context.Canceled) && cmd.Context().Err() != nil:
				return nil // interrupted while following
			}
			return err
		},
	}
	cmd.Flags().BoolVarP(&follow, "follow", "f", false, "keep printing new entries as they arrive")
	cmd.Flags().DurationVar(&since, "since", 0, "only entries newer than this, e.g. 10m or 2h (default: all kept)")
	cmd.Flags().StringVar(&level, "level", "", "only entries at this level or above: info, warn or error")
	cmd.Flags().StringVarP(&output, "output", "o", "", "table or json (default: table on a terminal, json lines otherwise)")
	return cmd
}

// formatLogLine renders an entry for a terminal: local time, level, message and the
// fields other than the stream (the level already tells stdout from stderr).
func formatLogLine(e api.SandboxLogEntry) string {
	var b strings.Builder
	fmt.Fprintf(&b, "%s %-5s %s", e.Timestamp.Local().Format("2006-01-02T15:04:05.000Z07:00"), strings.ToUpper(string(e.Level)), e.Message)
	keys := make([]string, 0, len(e.Fields))
	for k := range e.Fields {
		if k != "stream" {
			keys = append(keys, k)
		}
	}
	slices.Sort(keys)
	for _, k := range keys {
		fmt.Fprintf(&b, " %s=%s", k, e.Fields[k])
	}
	b.WriteByte('\n')
	return b.String()
}

// readLogs pages forward through the logs of id with the v2 cursor, passing each entry
// once to emit, and when following polls for more until ctx ends. The cursor has
// millisecond precision and is inclusive, so every page repeats the entries of the
// cursor's millisecond already emitted: they are skipped by count, as entries of the
// same millisecond keep their order.
func (c *client) readLogs(ctx context.Context, id string, o logsOpts, emit func(api.SandboxLogEntry) error) error {
	cursor := int64(0)
	if !o.since.IsZero() {
		cursor = o.since.UnixMilli()
	}
	seen := 0 // entries emitted whose timestamp is in the cursor's millisecond
	fwd := "forward"
	params := api.GetSandboxLogsV2Params{Direction: &fwd, Limit: &o.pageSize}
	if o.level != "" {
		lvl := api.LogLevel(o.level)
		params.Level = &lvl
	}
	got := false
	for {
		params.Cursor = &cursor
		resp, err := c.api.GetSandboxLogsV2WithResponse(ctx, id, &params)
		if err != nil {
			if ctx.Err() != nil {
				return ctx.Err()
			}
			return c.transportErr(err)
		}
		switch {
		case resp.StatusCode() == http.StatusNotFound && got:
			return errSandboxGone
		case resp.StatusCode() == http.StatusNotFound:
			return fmt.Errorf("sandbox %s not found on %s (`aenv ls` lists sandboxes)", id, c.base)
		case resp.JSON200 == nil:
			return c.apiErr("logs of "+id, resp.StatusCode(), resp.Body)
		}
		got = true
		page := resp.JSON200.Logs
		start, skip := cursor, seen
		for _, e := range page {
			ms := e.Timestamp.UnixMilli()
			if ms == start && skip > 0 {
				skip--
				continue
			}
			if err := emit(e); err != nil {
				return err
			}
			if ms != cursor {
				cursor, seen = ms, 0
			}
			seen++
		}
		if len(page) > 0 && len(page) == int(o.pageSize) {
			if page[len(page)-1].Timestamp.UnixMilli() == start {
				// A whole page in one millisecond: step past it rather than ask for
				// the same page forever (what else that millisecond holds is lost).
				cursor, seen = start+1, 0
			}
			continue // more to read now
		}
		if !o.follow {
			return nil
		}
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(o.interval):
		}
	}
}
