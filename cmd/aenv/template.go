package main

import (
	"fmt"
	"strings"

	"github.com/spf13/cobra"

	"github.com/aenv-dev/aenv/internal/template/base"
)

func newTemplateCmd(g *globals) *cobra.Command {
	cmd := &cobra.Command{
		Use:   "template",
		Short: "Build and manage templates",
	}
	var (
		out, busybox, bash, cache, mirror, suite string
		force, minimal                           bool
	)
	buildBase := &cobra.Command{
		Use:   "build-base --out DIR [--minimal]",
		Short: "Build the base template's root filesystem: Debian with python3, node, git, curl and sudo (debootstrap), or with --minimal busybox and bash",
		Long: "Builds the root filesystem `aenv serve --base-rootfs DIR` installs as the base template: Debian " +
			"(debootstrap --variant=minbase plus " + strings.Join(base.DebianPackages, ", ") + ") with a `user` account " +
			"that may sudo without a password. Needs root, debootstrap and the Debian mirror (a few minutes; --cache " +
			"keeps the packages). With --minimal: the base-minimal template's busybox and bash, copied from the host " +
			"(busybox-static, bash-static) in a second. Nothing is done when DIR already holds a finished build.",
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			if out == "" {
				return fmt.Errorf("--out DIR is required")
			}
			var err error
			if minimal {
				err = base.Build(cmd.Context(), base.Options{Out: out, Busybox: busybox, Bash: bash, Force: force})
			} else {
				stderr := cmd.ErrOrStderr()
				if !force && !base.DebianBuilt(out) {
					fmt.Fprintln(stderr, "building the Debian base with debootstrap (a few minutes the first time)")
				}
				err = base.BuildDebian(cmd.Context(), base.DebianOptions{Out: out, CacheDir: cache, Mirror: mirror,
					Suite: suite, Force: force, Progress: func(l string) { fmt.Fprintln(stderr, "debootstrap:", l) }})
			}
			if err != nil {
				return err
			}
			fmt.Fprintln(cmd.OutOrStdout(), "base rootfs ready in", out)
			return nil
		},
	}
	buildBase.Flags().StringVar(&out, "out", "", "directory to create (replaced atomically)")
	buildBase.Flags().BoolVar(&minimal, "minimal", false, "build the busybox base-minimal rootfs instead of the Debian base")
	buildBase.Flags().StringVar(&cache, "cache", "", "keep the downloaded Debian packages in this directory")
	buildBase.Flags().StringVar(&mirror, "mirror", "", "Debian mirror (default: the host's apt mirror, else http://deb.debian.org/debian)")
	buildBase.Flags().StringVar(&suite, "suite", base.DefaultSuite, "Debian release")
	buildBase.Flags().StringVar(&busybox, "busybox", "", "with --minimal: static busybox to copy (default /bin/busybox, Debian busybox-static)")
	buildBase.Flags().StringVar(&bash, "bash", "", "with --minimal: static bash to copy (default /bin/bash-static, Debian bash-static)")
	buildBase.Flags().BoolVar(&force, "force", false, "rebuild even if DIR holds a finished build")
	cmd.AddCommand(buildBase, newTemplateLsCmd(g), newTemplateRmCmd(g), newTemplateLogsCmd(g))
	return cmd
}
