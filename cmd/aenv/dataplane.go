package main

import (
	"errors"
	"os"
	"runtime/debug"

	"github.com/spf13/cobra"

	"github.com/aenv-dev/aenv/internal/config"
	"github.com/aenv-dev/aenv/internal/dataplane"
)

// version is set at link time (-ldflags "-X main.version=..."); buildVersion falls back to
// the VCS revision Go stamps into the binary.
var version = ""

// buildVersion names this binary in logs and in the data plane's answers, so an operator
// can tell which build serves the disks after an upgrade.
func buildVersion() string {
	if version != "" {
		return version
	}
	bi, ok := debug.ReadBuildInfo()
	if !ok {
		return "unknown"
	}
	v := bi.Main.Version
	for _, s := range bi.Settings {
		switch s.Key {
		case "vcs.revision":
			v = s.Value
		case "vcs.modified":
			if s.Value == "true" {
				v += "+dirty"
			}
		}
	}
	return v
}

func newDataplaneCmd() *cobra.Command {
	var dir string
	cmd := &cobra.Command{
		Use:   "dataplane",
		Short: "Serve the layered disks of a node's sandboxes (started by `aenv serve`)",
		Long: "dataplane serves the layer stacks behind the root disks of a node's sandboxes (FUSE files\n" +
			"under loop devices) from a process of its own, so the sandboxes outlive a crash, restart\n" +
			"or upgrade of `aenv serve`. The node starts it on demand in its own session and cgroup and\n" +
			"talks to it over DIR/dp.sock; there is no need to run it by hand. It exits on SIGTERM only\n" +
			"while it serves no disk (see docs/operations.md, \"The data plane\").",
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			log := newLogger(defaultLogConfig()).With("component", "dataplane")
			err := dataplane.Run(cmd.Context(), dir, buildVersion(), log)
			if errors.Is(err, dataplane.ErrRunning) {
				log.Info("another data plane serves this directory; exiting", "dir", dir)
				return nil
			}
			return err
		},
	}
	cmd.Flags().StringVar(&dir, "dir", "", "the data plane's directory (socket, lock, log): DATA_DIR/dataplane")
	_ = cmd.MarkFlagRequired("dir")
	return cmd
}

// defaultLogConfig is the log settings from AENV_* variables (the node passes its
// environment to the data plane it starts).
func defaultLogConfig() config.Config {
	cfg, err := config.Load("", os.LookupEnv)
	if err != nil {
		return config.Default()
	}
	return cfg
}
