package main

import (
	"encoding/json"
	"fmt"
	"io"
	"io/fs"
	"mime/multipart"
	"net/http"
	"net/textproto"
	"net/url"
	"os"
	"path"
	"path/filepath"
	"strings"

	"github.com/spf13/cobra"

	"github.com/aenv-dev/aenv/internal/envd/gen/filesystem"
)

func queryEscape(s string) string { return url.QueryEscape(s) }

// filesURL is envd's /files endpoint through the node (routed by the sandbox headers).
func (e *envdClient) filesURL(path, user string) string {
	q := url.Values{"path": {path}}
	if user != "" {
		q.Set("username", user)
	}
	return e.c.base + "/files?" + q.Encode()
}

// upload streams a local file to path in the sandbox as a multipart part named "file",
// as the SDKs do; envd creates parent directories and chowns to the user.
func (e *envdClient) upload(cmd *cobra.Command, local, remote, user string) error {
	f, err := os.Open(local)
	if err != nil {
		return err
	}
	defer f.Close()
	fi, err := f.Stat()
	if err != nil {
		return err
	}
	if fi.IsDir() {
		return e.uploadDir(cmd, local, remote, user)
	}
	pr, pw := io.Pipe()
	mw := multipart.NewWriter(pw)
	go func() {
		h := textproto.MIMEHeader{}
		h.Set("Content-Disposition", fmt.Sprintf(`form-data; name="file"; filename=%q`, remote))
		h.Set("Content-Type", "application/octet-stream")
		part, err := mw.CreatePart(h)
		if err == nil {
			_, err = io.Copy(part, f)
		}
		if err == nil {
			err = mw.Close()
		}
		pw.CloseWithError(err)
	}()
	req, err := http.NewRequestWithContext(cmd.Context(), http.MethodPost, e.filesURL(remote, user), pr)
	if err != nil {
		return err
	}
	req.Header.Set("Content-Type", mw.FormDataContentType())
	e.setHeaders(req.Header)
	resp, err := e.c.http.Do(req)
	if err != nil {
		return e.c.transportErr(err)
	}
	defer resp.Body.Close()
	body, _ := io.ReadAll(io.LimitReader(resp.Body, 1<<20))
	if resp.StatusCode != http.StatusOK {
		return e.c.apiErr(fmt.Sprintf("upload to %s:%s", e.id, remote), resp.StatusCode, body)
	}
	var entries []struct{ Path string }
	if json.Unmarshal(body, &entries) != nil || len(entries) != 1 {
		return fmt.Errorf("upload to %s:%s: unexpected answer %q", e.id, remote, body)
	}
	var fix remoteFixups
	fix.mode(entries[0].Path, fi.Mode())
	if err := e.applyFixups(cmd.Context(), fix, user); err != nil {
		return err
	}
	fmt.Fprintf(cmd.OutOrStdout(), "uploaded %s to %s:%s\n", local, e.id, entries[0].Path)
	return nil
}

// download writes the sandbox file remote to local ("-" = stdout) through a temporary
// file, so an interrupted download never leaves a truncated file behind.
func (e *envdClient) download(cmd *cobra.Command, remote, local, user string, mode fs.FileMode, force, report bool) error {
	if local != "-" {
		if fi, err := os.Stat(local); err == nil {
			if fi.IsDir() {
				local = filepath.Join(local, filepath.Base(remote))
			} else if !force {
				return fmt.Errorf("%s exists; pass --force to overwrite it", local)
			}
		}
	}
	req, err := http.NewRequestWithContext(cmd.Context(), http.MethodGet, e.filesURL(remote, user), nil)
	if err != nil {
		return err
	}
	e.setHeaders(req.Header)
	resp, err := e.c.http.Do(req)
	if err != nil {
		return e.c.transportErr(err)
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		body, _ := io.ReadAll(io.LimitReader(resp.Body, 1<<20))
		return e.c.apiErr(fmt.Sprintf("download %s:%s", e.id, remote), resp.StatusCode, body)
	}
	if local == "-" {
		_, err := io.Copy(cmd.OutOrStdout(), resp.Body)
		return err
	}
	tmp, err := os.CreateTemp(filepath.Dir(local), "."+filepath.Base(local)+".part-")
	if err != nil {
		return err
	}
	defer os.Remove(tmp.Name())
	if _, err := io.Copy(tmp, resp.Body); err != nil {
		tmp.Close()
		return fmt.Errorf("download %s:%s: %w", e.id, remote, err)
	}
	if err := tmp.Chmod(mode.Perm()); err != nil {
		tmp.Close()
		return err
	}
	if err := tmp.Close(); err != nil {
		return err
	}
	if err := os.Rename(tmp.Name(), local); err != nil {
		return err
	}
	if report {
		fmt.Fprintf(cmd.OutOrStdout(), "downloaded %s:%s to %s\n", e.id, remote, local)
	}
	return nil
}

func newUploadCmd(g *globals) *cobra.Command {
	var user string
	cmd := &cobra.Command{
		Use:     "upload SANDBOX LOCAL_PATH REMOTE_PATH",
		Short:   "Copy a file or directory (recursively) into a sandbox",
		Example: "  aenv upload sbx123 ./data.csv /home/user/data.csv",
		Args:    cobra.ExactArgs(3),
		RunE: func(cmd *cobra.Command, args []string) error {
			c, err := g.client()
			if err != nil {
				return err
			}
			e, err := c.envdFor(cmd.Context(), args[0])
			if err != nil {
				return err
			}
			return e.upload(cmd, args[1], args[2], user)
		},
	}
	cmd.Flags().StringVar(&user, "user", "", "owner of the file in the sandbox (default: the sandbox's default user)")
	return cmd
}

func newDownloadCmd(g *globals) *cobra.Command {
	var (
		user  string
		force bool
	)
	cmd := &cobra.Command{
		Use:     "download SANDBOX REMOTE_PATH [LOCAL_PATH|-]",
		Short:   "Copy a file or directory (recursively) out of a sandbox (\"-\" writes a file to stdout)",
		Example: "  aenv download sbx123 /home/user/out.txt .",
		Args:    cobra.RangeArgs(2, 3),
		RunE: func(cmd *cobra.Command, args []string) error {
			local := filepath.Base(strings.TrimRight(args[1], "/"))
			if len(args) == 3 {
				local = args[2]
			}
			c, err := g.client()
			if err != nil {
				return err
			}
			e, err := c.envdFor(cmd.Context(), args[0])
			if err != nil {
				return err
			}
			ent, err := e.statRemote(cmd, args[1], user)
			if err != nil {
				return err
			}
			if ent.GetType() == filesystem.FileType_FILE_TYPE_DIRECTORY {
				if local == "-" {
					return fmt.Errorf("%s is a directory: give a local directory instead of -", args[1])
				}
				if fi, err := os.Stat(local); err == nil && fi.IsDir() && len(args) == 3 {
					local = filepath.Join(local, path.Base(ent.GetPath())) // like cp -r
				}
				return e.downloadDir(cmd, ent.GetPath(), local, user, force)
			}
			return e.download(cmd, args[1], local, user, fs.FileMode(ent.GetMode()), force, true)
		},
	}
	cmd.Flags().StringVar(&user, "user", "", "read as this user (default: the sandbox's default user)")
	cmd.Flags().BoolVar(&force, "force", false, "overwrite LOCAL_PATH if it exists")
	return cmd
}
