package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"strings"
	"time"

	"github.com/spf13/cobra"

	"github.com/aenv-dev/aenv/internal/catalog"
	"github.com/aenv-dev/aenv/internal/config"
	"github.com/aenv-dev/aenv/internal/image"
	"github.com/aenv-dev/aenv/internal/image/install"
)

func newPullCmd() *cobra.Command {
	var (
		req      install.Request
		dataDir  string
		probe    int
		platform string
		timeout  time.Duration
	)
	cmd := &cobra.Command{
		Use:   "pull REF",
		Short: "Pull an OCI image and register it as a template on this node",
		Long: "Pull an image and make it a template sandboxes can be created from.\n\n" +
			"REF is a registry reference (ubuntu:22.04, 127.0.0.1:5000/app:v1) or, with skopeo's\n" +
			"prefixes, oci:PATH[:TAG], oci-archive:PATH[:TAG] or docker-archive:PATH.\n" +
			"Credentials come from ~/.docker/config.json (or --docker-config); registries on\n" +
			"loopback addresses and those given with --insecure-registry are reached over http.\n\n" +
			"pull writes into the node's data directory and catalog, so it runs on the node while\n" +
			"`aenv serve` is stopped; a running node's catalog is locked, and templates are then\n" +
			"built through its API (POST /v3/templates).",
		Args: cobra.ExactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			req.Ref = args[0]
			req.DataDir = firstNonEmpty(dataDir, os.Getenv("AENV_DATA_DIR"), config.Default().DataDir)
			if probe != 0 {
				if req.ReadyCmd != "" {
					return errors.New("--probe and --ready-cmd are exclusive")
				}
				req.ReadyCmd = fmt.Sprintf(": >/dev/tcp/127.0.0.1/%d", probe)
			}
			if platform != "" {
				p, err := parsePullPlatform(platform)
				if err != nil {
					return err
				}
				req.Pull.Platform = &p
			}
			path := filepath.Join(req.DataDir, catalogFile)
			cat, err := catalog.Open(path)
			if err != nil {
				return fmt.Errorf("cannot open the node's catalog %s: %w\n"+
					"(is `aenv serve` running on this data dir? then build the template through the node's API, "+
					"or stop the node and pull again)", path, err)
			}
			defer cat.Close()
			stderr := cmd.ErrOrStderr()
			f, _ := stderr.(*os.File)
			pr := newPullProgress(stderr, f != nil && isTerminal(f))
			req.Progress = pr.report
			ctx := cmd.Context()
			if timeout > 0 {
				var cancel context.CancelFunc
				ctx, cancel = context.WithTimeout(ctx, timeout)
				defer cancel()
			}
			start := time.Now()
			t, err := install.Run(ctx, cat.Templates(), req)
			pr.finish()
			if err != nil {
				return err
			}
			fmt.Fprintf(stderr, "pulled %s in %s\n", req.Ref, time.Since(start).Round(time.Millisecond))
			fmt.Fprintf(cmd.OutOrStdout(), "%s\t%s\n", t.ID, strings.Join(t.Aliases, ","))
			return nil
		},
	}
	fl := cmd.Flags()
	fl.StringVar(&req.Name, "name", "", "template name (alias); default: the image's repository name")
	fl.IntVar(&req.Resources.CPUCount, "cpu", 0, "default vCPUs for sandboxes from this template")
	fl.IntVar(&req.Resources.MemoryMB, "memory", 0, "default memory (MiB)")
	fl.IntVar(&req.Resources.DiskSizeMB, "disk-mb", 0, "disk size (MiB) of sandboxes and of the converted ext4")
	fl.StringVar(&req.StartCmd, "start-cmd", "", "command started in each sandbox")
	fl.StringVar(&req.ReadyCmd, "ready-cmd", "", "command that succeeds once the start command is ready")
	fl.IntVar(&probe, "probe", 0, "ready when this TCP port accepts connections (instead of --ready-cmd)")
	fl.BoolVar(&req.StartFromImage, "start-from-image", false, "use the image's ENTRYPOINT and CMD as the start command")
	fl.BoolVar(&req.Convert, "convert", false, "also convert the layers to overlaybd (needs root, FUSE, loop devices, mkfs.ext4)")
	fl.StringVar(&dataDir, "data-dir", "", "the node's data directory (default $AENV_DATA_DIR or "+config.Default().DataDir+")")
	fl.StringSliceVar(&req.Pull.InsecureRegistries, "insecure-registry", nil, "registry host:port to reach over plain http (repeatable)")
	fl.StringVar(&req.Pull.DockerConfig, "docker-config", "", "docker config.json with registry credentials")
	fl.DurationVar(&timeout, "timeout", 0, "give up after this long (e.g. 10m); 0 = no limit")
	fl.StringVar(&platform, "platform", "", "os/arch[/variant] to pick from multi-platform images (default the host's)")
	return cmd
}

// pullProgress renders image.Progress: one rewritten line on a terminal,
// a line per finished layer step otherwise.
type pullProgress struct {
	w     io.Writer
	tty   bool
	last  time.Time
	dirty bool
	phase image.Phase
}

func newPullProgress(w io.Writer, tty bool) *pullProgress { return &pullProgress{w: w, tty: tty} }

func (p *pullProgress) report(ev image.Progress) {
	d := ev.Digest
	if len(d) > 19 {
		d = d[:19]
	}
	state := fmt.Sprintf("%s / %s", pullBytes(ev.Done), pullBytes(ev.Total))
	if ev.Cached {
		state = "cached"
	}
	line := fmt.Sprintf("%-8s layer %d/%d %s %s", ev.Phase, ev.Layer, ev.Layers, d, state)
	if !p.tty {
		if ev.Final {
			fmt.Fprintln(p.w, line)
		}
		return
	}
	if ev.Phase != p.phase {
		// Keep the last line of the previous phase (download, apply, convert).
		p.finish()
		p.phase = ev.Phase
	} else if !ev.Final && time.Since(p.last) < 100*time.Millisecond {
		return
	}
	p.last = time.Now()
	fmt.Fprintf(p.w, "\r\033[K%s", line)
	p.dirty = true
}

func (p *pullProgress) finish() {
	if p.dirty {
		fmt.Fprintln(p.w)
		p.dirty = false
	}
}

func pullBytes(n int64) string {
	switch {
	case n >= 1<<30:
		return fmt.Sprintf("%.1f GiB", float64(n)/(1<<30))
	case n >= 1<<20:
		return fmt.Sprintf("%.1f MiB", float64(n)/(1<<20))
	case n >= 1<<10:
		return fmt.Sprintf("%.1f KiB", float64(n)/(1<<10))
	}
	return fmt.Sprintf("%d B", n)
}

func parsePullPlatform(s string) (image.Platform, error) {
	parts := strings.Split(s, "/")
	if len(parts) < 2 || len(parts) > 3 || parts[0] == "" || parts[1] == "" {
		return image.Platform{}, fmt.Errorf("--platform %q: want os/arch[/variant]", s)
	}
	p := image.Platform{OS: parts[0], Architecture: parts[1]}
	if len(parts) == 3 {
		p.Variant = parts[2]
	}
	return p, nil
}
