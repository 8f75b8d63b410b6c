package main

import (
	"fmt"

	"github.com/spf13/cobra"

	"github.com/aenv-dev/aenv/internal/template/base"
)

func newTemplateCmd(g *globals) *cobra.Command {
	cmd := &cobra.Command{
		Use:   "template",
		Short: "Build and manage templates",
	}
	var (
		out, busybox, bash string
		force              bool
	)
	buildBase := &cobra.Command{
		Use:   "build-base --out DIR",
		Short: "Build the base template's root filesystem (busybox, bash, a `user` account) from the host's static binaries",
		Args:  cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			if out == "" {
				return fmt.Errorf("--out DIR is required")
			}
			if err := base.Build(cmd.Context(), base.Options{Out: out, Busybox: busybox, Bash: bash, Force: force}); err != nil {
				return err
			}
			fmt.Fprintln(cmd.ErrOrStderr(), "base rootfs ready in", out)
			return nil
		},
	}
	buildBase.Flags().StringVar(&out, "out", "", "directory to create (replaced atomically)")
	buildBase.Flags().StringVar(&busybox, "busybox", "", "static busybox to copy (default /bin/busybox, Debian busybox-static)")
	buildBase.Flags().StringVar(&bash, "bash", "", "static bash to copy (default /bin/bash-static, Debian bash-static)")
	buildBase.Flags().BoolVar(&force, "force", false, "rebuild even if DIR holds a finished build")
	cmd.AddCommand(buildBase, newTemplateLsCmd(g), newTemplateRmCmd(g), newTemplateLogsCmd(g))
	return cmd
}
