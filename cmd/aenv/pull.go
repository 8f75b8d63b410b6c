package main

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"time"

	"github.com/spf13/cobra"

	"github.com/aenv-dev/aenv/internal/catalog"
	"github.com/aenv-dev/aenv/internal/config"
	"github.com/aenv-dev/aenv/internal/image"
	"github.com/aenv-dev/aenv/internal/image/install"
	"github.com/aenv-dev/aenv/internal/server/api"
	"github.com/aenv-dev/aenv/internal/template/build"
)

func newPullCmd(g *globals) *cobra.Command {
	var (
		req      install.Request
		dataDir  string
		probe    int
		platform string
		timeout  time.Duration
		detach   bool
	)
	cmd := &cobra.Command{
		Use:   "pull REF",
		Short: "Pull an OCI image and register it as a template on this node",
		Long: "Pull an image and make it a template sandboxes can be created from.\n\n" +
			"REF is a registry reference (ubuntu:22.04, 127.0.0.1:5000/app:v1) or, with skopeo's\n" +
			"prefixes, oci:PATH[:TAG], oci-archive:PATH[:TAG] or docker-archive:PATH.\n" +
			"Credentials come from ~/.docker/config.json (or --docker-config); registries on\n" +
			"loopback addresses and those given with --insecure-registry are reached over http.\n\n" +
			"When a node answers at --url (or $AENV_URL, `aenv login`, http://127.0.0.1:8000), the\n" +
			"node pulls the image itself (POST /aenv/templates/pull) and the template can be used\n" +
			"right away; oci:/archive paths then name files on the node. Otherwise, or with\n" +
			"--data-dir, pull writes into a stopped node's data directory and catalog directly.\n" +
			"A name that already is a template is replaced through the API (sandboxes on the old\n" +
			"version keep running); the direct path refuses it.\n\n" +
			"With -d the node imports the image as a template build (POST /v3/templates) and pull\n" +
			"returns at once; follow it with `aenv template logs -f`.",
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
			stderr := cmd.ErrOrStderr()
			if detach {
				return pullDetached(cmd, g, req)
			}
			pr := newPullProgress(stderr)
			req.Progress = pr.report
			ctx := cmd.Context()
			if timeout > 0 {
				var cancel context.CancelFunc
				ctx, cancel = context.WithTimeout(ctx, timeout)
				defer cancel()
			}
			start := time.Now()
			var (
				t   catalog.Template
				err error
			)
			c, apiErr := pullClient(ctx, g, cmd.Flags().Changed("data-dir"))
			if c != nil {
				if req.Pull.DockerConfig != "" {
					return errors.New("--docker-config names a file on this machine; the node uses its own " +
						"registry credentials (its ~/.docker/config.json), or pass --data-dir to pull directly")
				}
				t, err = c.pullTemplate(ctx, pullBody(req, cmd.Flags().Changed("convert"), platform), pr)
			} else {
				t, err = pullDirect(ctx, req, apiErr)
			}
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
	fl.StringVar(&req.User, "user", "", "default user of sandboxes (an account or uid of the image); default: the image's USER, else the account named user")
	fl.BoolVar(&req.Convert, "convert", false, "also convert the layers to overlaybd (needs root, FUSE, loop devices, mkfs.ext4; "+
		"through a node: default on where its base template is layered)")
	fl.StringVar(&dataDir, "data-dir", "", "write into this stopped node's data directory instead of asking a running node "+
		"(default when no node answers: $AENV_DATA_DIR or "+config.Default().DataDir+")")
	fl.StringSliceVar(&req.Pull.InsecureRegistries, "insecure-registry", nil, "registry host:port to reach over plain http (repeatable)")
	fl.StringVar(&req.Pull.DockerConfig, "docker-config", "", "docker config.json with registry credentials")
	fl.Var(secondsOrDuration{&timeout}, "timeout", "give up after this long: seconds (600) or a duration (10m); 0 = no limit")
	fl.BoolVarP(&detach, "detach", "d", false, "have the node import the image as a template build and return at once")
	// agentenv's spellings of the resource flags.
	fl.IntVar(&req.Resources.CPUCount, "cpu-count", 0, "same as --cpu")
	fl.IntVar(&req.Resources.MemoryMB, "memory-mb", 0, "same as --memory")
	fl.IntVar(&req.Resources.MemoryMB, "mem", 0, "same as --memory")
	for _, n := range []string{"cpu-count", "memory-mb", "mem"} {
		fl.MarkHidden(n)
	}
	fl.StringVar(&platform, "platform", "", "os/arch[/variant] to pick from multi-platform images (default the host's)")
	return cmd
}

// pullProgress renders image.Progress as one line per layer and phase, printed when
// that layer finishes the phase. Layers download a few at a time, so a line rewritten in
// place would show them interleaved on one line; finished lines never change, on a
// terminal or in a log file alike.
type pullProgress struct {
	w     io.Writer
	start map[pullStep]time.Time
}

type pullStep struct {
	phase image.Phase
	layer int
}

func newPullProgress(w io.Writer) *pullProgress {
	return &pullProgress{w: w, start: map[pullStep]time.Time{}}
}

func (p *pullProgress) report(ev image.Progress) {
	k := pullStep{ev.Phase, ev.Layer}
	if _, ok := p.start[k]; !ok {
		p.start[k] = time.Now()
	}
	if !ev.Final {
		return
	}
	d := ev.Digest
	if len(d) > 19 {
		d = d[:19]
	}
	state := pullBytes(ev.Total)
	if ev.Cached {
		state = "cached"
	} else if took := time.Since(p.start[k]); took >= 10*time.Millisecond {
		state += " in " + took.Round(10*time.Millisecond).String()
	}
	fmt.Fprintf(p.w, "%-8s layer %d/%d %s %s\n", ev.Phase, ev.Layer, ev.Layers, d, state)
	delete(p.start, k)
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

// pullClient returns a client for the node pull should go through, or nil for the direct
// catalog path: when --data-dir was given, or when no node answers (then err says why,
// for the message should the direct path fail too).
func pullClient(ctx context.Context, g *globals, direct bool) (*client, error) {
	if direct {
		return nil, nil
	}
	c, err := g.client()
	if err != nil {
		return nil, err
	}
	hctx, cancel := context.WithTimeout(ctx, 3*time.Second)
	defer cancel()
	hreq, err := http.NewRequestWithContext(hctx, http.MethodGet, c.base+"/health", nil)
	if err != nil {
		return nil, err
	}
	resp, err := c.http.Do(hreq)
	if err != nil {
		return nil, c.transportErr(err)
	}
	resp.Body.Close()
	return c, nil
}

// pullDirect installs into a stopped node's data directory.
func pullDirect(ctx context.Context, req install.Request, apiErr error) (catalog.Template, error) {
	path := filepath.Join(req.DataDir, catalogFile)
	cat, err := catalog.Open(path)
	if err != nil {
		hint := "is `aenv serve` running on this data dir? then pull through its API (drop --data-dir, set --url), " +
			"or stop the node and pull again"
		if apiErr != nil {
			hint = "the API was not usable either: " + apiErr.Error()
		}
		return catalog.Template{}, fmt.Errorf("cannot open the node's catalog %s: %w\n(%s)", path, err, hint)
	}
	defer cat.Close()
	return install.Run(ctx, cat.Templates(), req)
}

// pullBody turns the flags into the API request. Convert is sent only when given, so
// the node picks its default (layered where its base template is).
func pullBody(req install.Request, convertSet bool, platform string) api.TemplatePullRequest {
	b := api.TemplatePullRequest{Ref: nodeRef(req.Ref)}
	str := func(s string) *string {
		if s == "" {
			return nil
		}
		return &s
	}
	num := func(n int) *int32 {
		if n == 0 {
			return nil
		}
		v := int32(n)
		return &v
	}
	b.Name, b.StartCmd, b.ReadyCmd, b.Platform = str(req.Name), str(req.StartCmd), str(req.ReadyCmd), str(platform)
	b.User = str(req.User)
	b.CpuCount, b.MemoryMB, b.DiskSizeMB = num(req.Resources.CPUCount), num(req.Resources.MemoryMB), num(req.Resources.DiskSizeMB)
	if req.StartFromImage {
		b.StartFromImage = &req.StartFromImage
	}
	if convertSet {
		b.Convert = &req.Convert
	}
	if len(req.Pull.InsecureRegistries) > 0 {
		b.InsecureRegistries = &req.Pull.InsecureRegistries
	}
	return b
}

// nodeRef is ref as the node must read it: layout and archive paths are read by the
// node, which does not share our cwd, so a relative one is made absolute.
func nodeRef(ref string) string {
	if src, err := image.ParseReference(ref); err == nil && src.Transport != image.Registry && !filepath.IsAbs(src.Path) {
		if abs, err := filepath.Abs(src.Path); err == nil {
			ref = strings.Replace(ref, src.Path, abs, 1)
		}
	}
	return ref
}

// pullTemplate runs a pull on the node, rendering its progress stream with pr.
func (c *client) pullTemplate(ctx context.Context, body api.TemplatePullRequest, pr *pullProgress) (catalog.Template, error) {
	raw, err := json.Marshal(body)
	if err != nil {
		return catalog.Template{}, err
	}
	hreq, err := http.NewRequestWithContext(ctx, http.MethodPost, c.base+"/aenv/templates/pull", bytes.NewReader(raw))
	if err != nil {
		return catalog.Template{}, err
	}
	hreq.Header.Set("Content-Type", "application/json")
	hreq.Header.Set("X-API-Key", c.key)
	resp, err := c.http.Do(hreq)
	if err != nil {
		return catalog.Template{}, c.transportErr(err)
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		b, _ := io.ReadAll(io.LimitReader(resp.Body, 64<<10))
		if resp.StatusCode == http.StatusNotFound {
			return catalog.Template{}, fmt.Errorf("the node at %s cannot pull images through its API (an older aenv?): "+
				"stop it and run `aenv pull --data-dir DIR`, or upgrade it", c.base)
		}
		return catalog.Template{}, c.apiErr("pull "+body.Ref, resp.StatusCode, b)
	}
	sc := bufio.NewScanner(resp.Body)
	sc.Buffer(make([]byte, 64<<10), 1<<20)
	for sc.Scan() {
		var ev api.TemplatePullEvent
		if err := json.Unmarshal(sc.Bytes(), &ev); err != nil {
			return catalog.Template{}, fmt.Errorf("pull %s: the node sent an unreadable progress line %q: %w", body.Ref, sc.Text(), err)
		}
		switch {
		case ev.Error != nil:
			return catalog.Template{}, fmt.Errorf("pull %s: %s (code %d)", body.Ref, ev.Error.Message, ev.Error.Code)
		case ev.Template != nil:
			t := catalog.Template{ID: ev.Template.TemplateID}
			for _, n := range ev.Template.Names {
				if n != t.ID {
					t.Aliases = append(t.Aliases, n)
				}
			}
			return t, nil
		case ev.Phase != nil:
			pr.report(eventProgress(ev))
		}
	}
	if err := sc.Err(); err != nil {
		return catalog.Template{}, fmt.Errorf("pull %s: reading the node's progress: %w", body.Ref, err)
	}
	return catalog.Template{}, fmt.Errorf("pull %s: the node ended the stream without a result (did it stop?)", body.Ref)
}

func eventProgress(ev api.TemplatePullEvent) image.Progress {
	p := image.Progress{Phase: image.Phase(*ev.Phase)}
	if ev.Layer != nil {
		p.Layer = *ev.Layer
	}
	if ev.Layers != nil {
		p.Layers = *ev.Layers
	}
	if ev.Digest != nil {
		p.Digest = *ev.Digest
	}
	if ev.Done != nil {
		p.Done = *ev.Done
	}
	if ev.Total != nil {
		p.Total = *ev.Total
	}
	p.Cached = ev.Cached != nil && *ev.Cached
	p.Final = ev.Final != nil && *ev.Final
	return p
}

// secondsOrDuration is --timeout: whole seconds, as agentenv's CLI takes them, or a Go
// duration.
type secondsOrDuration struct{ d *time.Duration }

func (f secondsOrDuration) String() string {
	if f.d == nil {
		return "0s"
	}
	return f.d.String()
}

func (f secondsOrDuration) Set(s string) error {
	if n, err := strconv.Atoi(s); err == nil && n >= 0 {
		*f.d = time.Duration(n) * time.Second
		return nil
	}
	d, err := time.ParseDuration(s)
	if err != nil || d < 0 {
		return fmt.Errorf("want seconds (600) or a duration (10m), got %q", s)
	}
	*f.d = d
	return nil
}

func (secondsOrDuration) Type() string { return "duration" }

// pullDetached imports the image through the node's template build API, which runs in
// the background and survives this command (the streamed pull stops when its client
// goes away).
func pullDetached(cmd *cobra.Command, g *globals, req install.Request) error {
	for _, f := range []string{"data-dir", "convert", "platform", "insecure-registry", "docker-config", "start-from-image", "disk-mb", "user"} {
		if cmd.Flags().Changed(f) {
			return fmt.Errorf("--%s is not available with -d: a detached pull is a template build on the node, "+
				"which has no such setting", f)
		}
	}
	src, err := image.ParseReference(req.Ref)
	if err != nil {
		return err
	}
	name := req.Name
	if name == "" {
		name = install.DefaultName(src)
	}
	c, err := g.client()
	if err != nil {
		return err
	}
	spec := build.Spec{FromImage: nodeRef(req.Ref), StartCmd: req.StartCmd, ReadyCmd: req.ReadyCmd}
	return runBuild(cmd.Context(), c, cmd.OutOrStdout(), cmd.ErrOrStderr(), buildRequest{name: name, spec: spec,
		cpu: req.Resources.CPUCount, memory: req.Resources.MemoryMB, detach: true})
}
