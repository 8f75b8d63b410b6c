// Command aenv is the aenv CLI and every aenv daemon (serve, and later gateway/scheduler).
package main

import (
	"context"
	"errors"
	"fmt"
	"os"
	"os/signal"
	"syscall"
	"time"

	"github.com/spf13/cobra"
)

func main() {
	os.Exit(run())
}

func run() int {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	err := newRootCmd().ExecuteContext(ctx)
	if err == nil {
		return 0
	}
	var ee exitCodeError
	if errors.As(err, &ee) {
		return ee.code
	}
	fmt.Fprintln(os.Stderr, "aenv:", err)
	return 1
}

// exitCodeError carries a remote command's exit status out of `aenv exec` and friends
// without printing anything more.
type exitCodeError struct{ code int }

func (e exitCodeError) Error() string { return fmt.Sprintf("exit status %d", e.code) }

// globals are the persistent flags every client command shares.
type globals struct {
	url    string
	apiKey string
	// dataDir is where a node on this machine keeps admin.key, the last fallback for the key
	// (set by commands that take --data-dir; default $AENV_DATA_DIR, then /var/lib/aenv).
	dataDir string
	// connectTimeout bounds dialing the node (and the TLS handshake); responseTimeout bounds
	// the wait for a response's headers once a request is sent (0: none). Streams (exec,
	// logs -f) are not cut: their headers come first.
	connectTimeout, responseTimeout time.Duration
}

func newRootCmd() *cobra.Command {
	g := &globals{}
	root := &cobra.Command{
		Use:   "aenv",
		Short: "Self-hosted sandboxes for AI agents, compatible with the E2B SDKs",
		Long: "aenv runs isolated Linux sandboxes on your own machines and serves the E2B API.\n\n" +
			"Start a node with `aenv serve`, then drive it with the E2B SDKs or with this CLI.\n" +
			"The CLI finds the node from --url, $AENV_URL or `aenv login` (default http://127.0.0.1:8000)\n" +
			"and its API key from --api-key, $AENV_API_KEY, `aenv login` or the node's admin.key.",
		SilenceUsage:  true,
		SilenceErrors: true,
	}
	root.PersistentFlags().StringVar(&g.url, "url", "", "node URL (default $AENV_URL, then aenv login (its saved URL), then http://127.0.0.1:8000)")
	root.PersistentFlags().StringVar(&g.apiKey, "api-key", "", "API key (default $AENV_API_KEY, then aenv login (its saved key), then the local node's admin.key)")
	root.PersistentFlags().DurationVar(&g.connectTimeout, "connect-timeout", 10*time.Second, "give up connecting to the node after this long")
	root.PersistentFlags().DurationVar(&g.responseTimeout, "response-timeout", 5*time.Minute,
		"give up when the node has not started answering a request after this long (0: wait forever)")
	root.AddCommand(
		newServeCmd(),
		newDataplaneCmd(),
		newSchedulerCmd(),
		newGatewayCmd(),
		newNodesCmd(g),
		newStartCmd(g),
		newListCmd(g),
		newInfoCmd(g),
		newExecCmd(g),
		newConnectCmd(g),
		newUploadCmd(g),
		newDownloadCmd(g),
		newPauseCmd(g),
		newResumeCmd(g),
		newSnapshotCmd(g),
		newForkCmd(g),
		newTimeoutCmd(g),
		newKillCmd(g),
		newKeysCmd(g),
		newLoginCmd(g),
		newTemplateCmd(g),
		newBuildCmd(g),
		newLayerCmd(),
		newBenchCmd(),
		newPullCmd(g),
		newLogsCmd(g),
	)
	addCompletions(root, g)
	return root
}
