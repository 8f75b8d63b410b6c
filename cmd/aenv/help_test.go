package main

import (
	"slices"
	"strings"
	"testing"

	"github.com/spf13/cobra"
	"github.com/spf13/pflag"
)

// TestHelpConsistency walks every command: a sandbox argument is always SANDBOX, flag
// placeholders are type names (a backquoted word in a usage becomes the placeholder),
// and every duration-valued flag is typed as a duration.
func TestHelpConsistency(t *testing.T) {
	var walk func(c *cobra.Command)
	walk = func(c *cobra.Command) {
		for _, w := range strings.Fields(c.Use)[1:] {
			w = strings.Trim(w, "[].")
			if w == "ID" || w == "SANDBOX_ID" || w == "SANDBOXID" {
				t.Errorf("%s: argument %q: sandboxes are SANDBOX everywhere", c.CommandPath(), w)
			}
		}
		c.LocalFlags().VisitAll(func(f *pflag.Flag) {
			name, _ := pflag.UnquoteUsage(f)
			if strings.Contains(f.Usage, "`") {
				t.Errorf("%s --%s: placeholder %q comes from a backquoted word", c.CommandPath(), f.Name, name)
			}
			durationy := strings.HasSuffix(f.Name, "timeout") || slices.Contains([]string{"since", "settle", "forget-after", "stale-after", "heartbeat-interval"}, f.Name)
			if durationy && f.Value.Type() != "duration" {
				t.Errorf("%s --%s is a %s, want a duration", c.CommandPath(), f.Name, f.Value.Type())
			}
		})
		for _, s := range c.Commands() {
			walk(s)
		}
	}
	walk(newRootCmd())
}

// TestCompletion: `aenv completion bash` writes a script, and the shell's hidden
// __complete query lists the node's sandbox IDs and template names.
func TestCompletion(t *testing.T) {
	url, _ := mockNode(t)
	id := strings.TrimSpace(mustAenv(t, url, "start", "-d"))
	if out, _, err := aenv(t, url, "completion", "bash"); err != nil || !strings.Contains(out, "__start_aenv") {
		t.Fatalf("completion bash: %v %.100s", err, out)
	}
	for _, tc := range []struct {
		args []string
		want string
		not  string
	}{
		{[]string{"__complete", "kill", ""}, id + "\trunning base", ""},
		{[]string{"__complete", "kill", id, ""}, id, ""}, // many sandboxes
		{[]string{"__complete", "exec", id[:3]}, id, ""},
		{[]string{"__complete", "exec", id, ""}, "", id}, // only the first argument
	} {
		out, _, err := aenv(t, url, tc.args...)
		if err != nil || !strings.Contains(out, tc.want) || (tc.not != "" && strings.Contains(out, tc.not)) {
			t.Errorf("aenv %q: %q %v", tc.args, out, err)
		}
	}
	// Template names, from a node that lists templates.
	turl, _ := pullNode(t)
	for _, args := range [][]string{{"__complete", "start", ""}, {"__complete", "template", "rm", ""}, {"__complete", "template", "logs", "ba"}} {
		if out, _, err := aenv(t, turl, args...); err != nil || !strings.Contains(out, "base\t") {
			t.Errorf("aenv %q: %q %v", args, out, err)
		}
	}
}
