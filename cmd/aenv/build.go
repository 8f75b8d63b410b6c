package main

import (
	"archive/tar"
	"context"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"net/http"
	"os"
	"path/filepath"
	"sort"
	"strings"
	"time"

	"github.com/spf13/cobra"

	"github.com/aenv-dev/aenv/internal/server/api"
	"github.com/aenv-dev/aenv/internal/template/build"
)

func newBuildCmd(g *globals) *cobra.Command {
	var (
		file, name  string
		buildArgs   []string
		cpu, memory int
		detach      bool
	)
	cmd := &cobra.Command{
		Use:   "build [-f Dockerfile] --name NAME [CONTEXT]",
		Short: "Build a template from a single-stage Dockerfile on the node",
		Long: "build parses the Dockerfile here (FROM, RUN, ENV, ARG, WORKDIR, USER, EXPOSE, LABEL,\n" +
			"COPY/ADD from the build context, CMD/ENTRYPOINT as the start command, HEALTHCHECK CMD as\n" +
			"the ready command), uploads the files COPY needs and has the node build the template,\n" +
			"streaming its log. Steps run as root unless the Dockerfile says USER; a Dockerfile\n" +
			"without USER leaves the template's default user `user`, as E2B templates have.\n" +
			"CONTEXT defaults to the current directory; -f defaults to CONTEXT/Dockerfile.",
		Args: cobra.MaximumNArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			if name == "" {
				return errors.New("--name is required")
			}
			ctxDir := "."
			if len(args) == 1 {
				ctxDir = args[0]
			}
			if file == "" {
				file = filepath.Join(ctxDir, "Dockerfile")
			}
			bargs, err := parseKV("--build-arg", buildArgs)
			if err != nil {
				return err
			}
			f, err := os.Open(file)
			if err != nil {
				return err
			}
			df, err := build.ParseDockerfile(f, bargs)
			f.Close()
			if err != nil {
				return fmt.Errorf("%s: %w", file, err)
			}
			for _, w := range df.Warnings {
				fmt.Fprintln(cmd.ErrOrStderr(), "warning:", w)
			}
			ignore, _, err := loadDockerignore(ctxDir, file)
			if err != nil {
				return err
			}
			c, err := g.client()
			if err != nil {
				return err
			}
			return runBuild(cmd.Context(), c, cmd.OutOrStdout(), cmd.ErrOrStderr(), buildRequest{name: name, ctxDir: ctxDir, ignore: ignore,
				spec: df.Spec(), cpu: cpu, memory: memory, detach: detach})
		},
	}
	fl := cmd.Flags()
	fl.StringVarP(&file, "file", "f", "", "Dockerfile (default CONTEXT/Dockerfile)")
	fl.StringVar(&name, "name", "", "template name (required); an existing template gets a new build")
	fl.StringArrayVar(&buildArgs, "build-arg", nil, "ARG value KEY=VALUE (repeatable)")
	fl.IntVar(&cpu, "cpu", 0, "vCPUs of the build sandbox and the template's sandboxes (default: node default)")
	fl.IntVar(&memory, "memory", 0, "memory MiB of the build sandbox and the template's sandboxes")
	fl.BoolVarP(&detach, "detach", "d", false, "start the build and return (follow it with: aenv template logs -f NAME)")
	return cmd
}

type buildRequest struct {
	name, ctxDir string
	ignore       *dockerignore
	spec         build.Spec
	cpu, memory  int
	detach       bool
}

// runBuild registers and runs a build. Its progress and log go to out (stderr); the result,
// the template's ID and name (as `aenv pull` prints them), to stdout.
func runBuild(ctx context.Context, c *client, stdout, out io.Writer, r buildRequest) error {
	// Every COPY source is read before the template is registered: a missing file fails
	// here and leaves nothing behind on the node.
	var uploads []*contextUpload
	defer func() {
		for _, u := range uploads {
			u.close()
		}
	}()
	for _, st := range r.spec.Steps {
		if st.Type != build.StepCopy {
			continue
		}
		u, err := packContext(r.ctxDir, st.Args[0], r.ignore)
		if err != nil {
			return err
		}
		uploads = append(uploads, u)
	}
	body := api.TemplateBuildRequestV3{Name: &r.name}
	if r.cpu > 0 {
		v := int32(r.cpu)
		body.CpuCount = &v
	}
	if r.memory > 0 {
		v := int32(r.memory)
		body.MemoryMB = &v
	}
	resp, err := c.api.RequestTemplateBuildV3WithResponse(ctx, body)
	if err != nil {
		return c.transportErr(err)
	}
	if resp.JSON202 == nil {
		return c.apiErr("request the build", resp.StatusCode(), resp.Body)
	}
	tid, bid := resp.JSON202.TemplateID, resp.JSON202.BuildID
	fmt.Fprintf(out, "template %s (%s), build %s\n", r.name, tid, bid)

	steps := make([]api.TemplateStep, 0, len(r.spec.Steps))
	next := 0
	for _, st := range r.spec.Steps {
		if st.Type == build.StepCopy {
			u := uploads[next]
			next++
			if err := u.upload(ctx, c, out, tid); err != nil {
				return err
			}
			st.FilesHash = u.hash
		}
		args := st.Args
		s := api.TemplateStep{Type: st.Type, Args: &args}
		if st.FilesHash != "" {
			h := st.FilesHash
			s.FilesHash = &h
		}
		steps = append(steps, s)
	}
	start := api.TemplateBuildStartV2{Steps: &steps}
	if r.spec.FromImage != "" {
		start.FromImage = &r.spec.FromImage
	}
	if r.spec.StartCmd != "" {
		start.StartCmd = &r.spec.StartCmd
	}
	if r.spec.ReadyCmd != "" {
		start.ReadyCmd = &r.spec.ReadyCmd
	}
	sresp, err := c.api.StartTemplateBuildV2WithResponse(ctx, tid, bid, start)
	if err != nil {
		return c.transportErr(err)
	}
	if sresp.StatusCode() != http.StatusAccepted {
		return c.apiErr("start the build", sresp.StatusCode(), sresp.Body)
	}
	if r.detach {
		fmt.Fprintf(out, "building; follow with `aenv template logs -f %s %s`\n", tid, bid)
	} else if err := followBuild(ctx, c, out, tid, bid, true); err != nil {
		return err
	}
	fmt.Fprintf(stdout, "%s\t%s\n", tid, r.name)
	return nil
}

// followBuild prints a build's log from the start and, with follow, until it ends; a
// failed build is an error naming the step.
func followBuild(ctx context.Context, c *client, out io.Writer, tid, bid string, follow bool) error {
	offset := int32(0)
	for {
		resp, err := c.api.GetTemplateBuildStatusWithResponse(ctx, tid, bid, &api.GetTemplateBuildStatusParams{LogsOffset: &offset})
		if err != nil {
			return c.transportErr(err)
		}
		if resp.JSON200 == nil {
			return c.apiErr("build status", resp.StatusCode(), resp.Body)
		}
		st := resp.JSON200
		for _, e := range st.LogEntries {
			fmt.Fprintf(out, "%s %-5s %s\n", e.Timestamp.Local().Format("15:04:05"), e.Level, e.Message)
		}
		offset += int32(len(st.LogEntries))
		switch st.Status {
		case api.TemplateBuildStatusReady:
			if len(st.LogEntries) == 0 {
				fmt.Fprintf(out, "template %s is ready\n", tid)
				return nil
			}
			continue // drain what was logged before the end
		case api.TemplateBuildStatusError:
			if len(st.LogEntries) > 0 {
				continue
			}
			msg, step := "unknown error", ""
			if st.Reason != nil {
				msg = st.Reason.Message
				if st.Reason.Step != nil {
					step = " at step " + *st.Reason.Step
				}
			}
			return fmt.Errorf("build %s failed%s: %s", bid, step, msg)
		}
		if !follow {
			fmt.Fprintf(out, "build %s is %s\n", bid, st.Status)
			return nil
		}
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(300 * time.Millisecond):
		}
	}
}

// contextUpload is the archive of the context files one COPY source selects, named by
// its hash.
type contextUpload struct {
	src   string
	file  *os.File
	files int
	size  int64
	hash  string
}

// packContext tars the context files src selects into a temporary file.
func packContext(ctxDir, src string, ignore *dockerignore) (*contextUpload, error) {
	tmp, err := os.CreateTemp("", "aenv-build-*.tar")
	if err != nil {
		return nil, err
	}
	u := &contextUpload{src: src, file: tmp}
	sum := sha256.New()
	if u.files, err = tarContext(io.MultiWriter(tmp, sum), ctxDir, src, ignore); err != nil {
		u.close()
		return nil, err
	}
	if u.size, err = tmp.Seek(0, io.SeekCurrent); err != nil {
		u.close()
		return nil, err
	}
	u.hash = hex.EncodeToString(sum.Sum(nil))
	return u, nil
}

func (u *contextUpload) close() {
	u.file.Close()
	os.Remove(u.file.Name())
}

// upload sends the archive unless the node has it already.
func (u *contextUpload) upload(ctx context.Context, c *client, out io.Writer, tid string) error {
	resp, err := c.api.GetTemplateFileUploadWithResponse(ctx, tid, u.hash)
	if err != nil {
		return c.transportErr(err)
	}
	if resp.JSON201 == nil {
		return c.apiErr("ask where to upload "+u.src, resp.StatusCode(), resp.Body)
	}
	if resp.JSON201.Present {
		fmt.Fprintf(out, "COPY %s: already on the node\n", u.src)
		return nil
	}
	if resp.JSON201.Url == nil {
		return fmt.Errorf("the node gave no upload URL for %s", u.src)
	}
	if _, err := u.file.Seek(0, io.SeekStart); err != nil {
		return err
	}
	req, err := http.NewRequestWithContext(ctx, http.MethodPut, *resp.JSON201.Url, io.NopCloser(u.file))
	if err != nil {
		return err
	}
	req.ContentLength = u.size
	if resp.JSON201.Headers != nil {
		for k, v := range *resp.JSON201.Headers {
			req.Header.Set(k, v)
		}
	}
	put, err := c.http.Do(req)
	if err != nil {
		return c.transportErr(err)
	}
	defer put.Body.Close()
	body, _ := io.ReadAll(io.LimitReader(put.Body, 4096))
	if put.StatusCode/100 != 2 {
		return c.apiErr("upload "+u.src, put.StatusCode, body)
	}
	fmt.Fprintf(out, "COPY %s: uploaded %d files (%d bytes)\n", u.src, u.files, u.size)
	return nil
}

// tarContext writes the context files src selects (a path or glob relative to ctxDir;
// directories recursively) as a tar with context-relative names, in a stable order,
// with their modes and modification times (COPY keeps both). Files ignore excludes
// (.dockerignore) are left out, as Docker never sends them. It refuses sources that
// match nothing or leave the context.
func tarContext(w io.Writer, ctxDir, src string, ignore *dockerignore) (int, error) {
	clean, err := build.ContextPath(src)
	if err != nil {
		return 0, fmt.Errorf("COPY %s: %w", src, err)
	}
	root, err := filepath.Abs(ctxDir)
	if err != nil {
		return 0, err
	}
	matches, err := filepath.Glob(filepath.Join(root, filepath.FromSlash(clean)))
	if err != nil {
		return 0, fmt.Errorf("COPY %s: %w", src, err)
	}
	if len(matches) == 0 {
		return 0, fmt.Errorf("COPY %s: no such file in the build context %s", src, ctxDir)
	}
	var files []string
	for _, m := range matches {
		err := filepath.WalkDir(m, func(p string, d fs.DirEntry, err error) error {
			if err != nil {
				return err
			}
			rel, rerr := filepath.Rel(root, p)
			if rerr != nil {
				return rerr
			}
			if ignore.excluded(filepath.ToSlash(rel)) {
				if d.IsDir() && !ignore.hasExceptions() {
					return filepath.SkipDir
				}
				return nil
			}
			files = append(files, p)
			return nil
		})
		if err != nil {
			return 0, err
		}
	}
	if len(files) == 0 {
		return 0, fmt.Errorf("COPY %s: no such file in the build context %s (.dockerignore excludes what matches)", src, ctxDir)
	}
	sort.Strings(files)
	tw := tar.NewWriter(w)
	for _, p := range files {
		rel, err := filepath.Rel(root, p)
		if err != nil || rel == ".." || strings.HasPrefix(rel, "../") {
			return 0, fmt.Errorf("COPY %s: %s is outside the build context", src, p)
		}
		fi, err := os.Lstat(p)
		if err != nil {
			return 0, err
		}
		link := ""
		if fi.Mode()&fs.ModeSymlink != 0 {
			if link, err = os.Readlink(p); err != nil {
				return 0, err
			}
		}
		h, err := tar.FileInfoHeader(fi, link)
		if err != nil {
			return 0, fmt.Errorf("COPY %s: %w", src, err)
		}
		h.Name = filepath.ToSlash(rel)
		if fi.IsDir() {
			h.Name += "/"
		}
		h.Uid, h.Gid, h.Uname, h.Gname = 0, 0, "", ""
		// COPY keeps modification times, so they are part of what the upload's hash names.
		h.ModTime = fi.ModTime().Truncate(time.Second)
		h.AccessTime, h.ChangeTime = time.Time{}, time.Time{}
		if err := tw.WriteHeader(h); err != nil {
			return 0, err
		}
		if fi.Mode().IsRegular() {
			f, err := os.Open(p)
			if err != nil {
				return 0, err
			}
			_, err = io.Copy(tw, f)
			f.Close()
			if err != nil {
				return 0, err
			}
		}
	}
	return len(files), tw.Close()
}
