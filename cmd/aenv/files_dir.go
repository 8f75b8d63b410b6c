package main

import (
	"errors"
	"fmt"
	"io"
	"io/fs"
	"mime/multipart"
	"net/http"
	"net/textproto"
	"os"
	"path"
	"path/filepath"
	"strings"

	"connectrpc.com/connect"
	"github.com/spf13/cobra"

	"github.com/aenv-dev/aenv/internal/envd/gen/filesystem"
	"github.com/aenv-dev/aenv/internal/envd/gen/filesystem/filesystemconnect"
	"github.com/aenv-dev/aenv/internal/envdclient"
)

// maxListDepth bounds a recursive directory download.
const maxListDepth = 64

func (e *envdClient) fs() filesystemconnect.FilesystemClient {
	return filesystemconnect.NewFilesystemClient(e.c.http, e.c.base, connect.WithInterceptors(e.envd.Interceptor()))
}

// uploadDir sends every regular file under local as one multipart request, each part named
// by its target path (envd's multi-file upload); parents are created in the sandbox.
func (e *envdClient) uploadDir(cmd *cobra.Command, local, remote, user string) error {
	var files []string
	var fix remoteFixups
	skipped := 0
	err := filepath.WalkDir(local, func(p string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		rel, err := filepath.Rel(local, p)
		if err != nil {
			return err
		}
		dst := path.Join(remote, filepath.ToSlash(rel))
		switch {
		case d.Type().IsRegular():
			files = append(files, p)
			if fi, err := d.Info(); err == nil {
				fix.mode(dst, fi.Mode())
			}
		case d.Type()&fs.ModeSymlink != 0:
			target, err := os.Readlink(p)
			if err != nil {
				return err
			}
			fix.link(dst, target)
		case !d.IsDir():
			skipped++
		}
		return nil
	})
	if err != nil {
		return err
	}
	if len(files) == 0 && len(fix.links) == 0 {
		return fmt.Errorf("%s has no regular files or symlinks to upload", local)
	}
	pr, pw := io.Pipe()
	mw := multipart.NewWriter(pw)
	go func() {
		pw.CloseWithError(writeParts(mw, local, remote, files))
	}()
	q := "/files"
	if user != "" {
		q += "?username=" + queryEscape(user)
	}
	req, err := http.NewRequestWithContext(cmd.Context(), http.MethodPost, e.c.base+q, pr)
	if err != nil {
		return err
	}
	req.Header.Set("Content-Type", mw.FormDataContentType())
	e.setHeaders(req.Header)
	if len(files) > 0 {
		resp, err := e.c.http.Do(req)
		if err != nil {
			return e.c.transportErr(err)
		}
		body, _ := io.ReadAll(io.LimitReader(resp.Body, 1<<20))
		resp.Body.Close()
		if resp.StatusCode != http.StatusOK {
			return e.c.apiErr(fmt.Sprintf("upload %s to %s:%s", local, e.id, remote), resp.StatusCode, body)
		}
	} else {
		pr.CloseWithError(errors.New("nothing to send"))
	}
	if err := e.applyFixups(cmd.Context(), fix, user); err != nil {
		return err
	}
	msg := fmt.Sprintf("uploaded %d files and %d symlinks from %s to %s:%s", len(files), len(fix.links), local, e.id, remote)
	if skipped > 0 {
		msg += fmt.Sprintf(" (skipped %d special files)", skipped)
	}
	fmt.Fprintln(cmd.OutOrStdout(), msg)
	return nil
}

func writeParts(mw *multipart.Writer, local, remote string, files []string) error {
	for _, p := range files {
		rel, err := filepath.Rel(local, p)
		if err != nil {
			return err
		}
		h := textproto.MIMEHeader{}
		h.Set("Content-Disposition", fmt.Sprintf(`form-data; name="file"; filename=%q`, path.Join(remote, filepath.ToSlash(rel))))
		h.Set("Content-Type", "application/octet-stream")
		part, err := mw.CreatePart(h)
		if err != nil {
			return err
		}
		f, err := os.Open(p)
		if err != nil {
			return err
		}
		_, err = io.Copy(part, f)
		f.Close()
		if err != nil {
			return err
		}
	}
	return mw.Close()
}

// statRemote returns the sandbox entry at remote (its Path is absolute).
func (e *envdClient) statRemote(cmd *cobra.Command, remote, user string) (*filesystem.EntryInfo, error) {
	req := connect.NewRequest(&filesystem.StatRequest{Path: remote})
	if user != "" {
		req.Header().Set("Authorization", envdclient.BasicUser(user))
	}
	resp, err := e.fs().Stat(cmd.Context(), req)
	if err != nil {
		if connect.CodeOf(err) == connect.CodeNotFound {
			return nil, fmt.Errorf("%s:%s does not exist", e.id, remote)
		}
		return nil, e.rpcErr(err)
	}
	return resp.Msg.GetEntry(), nil
}

// downloadDir fetches every file under the sandbox directory remote (an absolute path, as
// statRemote returns it) into local.
func (e *envdClient) downloadDir(cmd *cobra.Command, remote, local, user string, force bool) error {
	req := connect.NewRequest(&filesystem.ListDirRequest{Path: remote, Depth: maxListDepth})
	if user != "" {
		req.Header().Set("Authorization", envdclient.BasicUser(user))
	}
	resp, err := e.fs().ListDir(cmd.Context(), req)
	if err != nil {
		return e.rpcErr(err)
	}
	base := strings.TrimRight(remote, "/")
	if err := os.MkdirAll(local, 0o755); err != nil {
		return err
	}
	n, links := 0, 0
	for _, ent := range resp.Msg.GetEntries() {
		rel, ok := strings.CutPrefix(ent.GetPath(), base+"/")
		if !ok || rel == "" || strings.Contains("/"+rel+"/", "/../") {
			continue // never write outside local
		}
		dst := filepath.Join(local, filepath.FromSlash(rel))
		if ent.SymlinkTarget != nil {
			if err := downloadLink(ent, base, local, dst, force); err != nil {
				return err
			}
			links++
			continue
		}
		switch ent.GetType() {
		case filesystem.FileType_FILE_TYPE_DIRECTORY:
			if err := os.MkdirAll(dst, 0o755); err != nil {
				return err
			}
		case filesystem.FileType_FILE_TYPE_FILE:
			if err := os.MkdirAll(filepath.Dir(dst), 0o755); err != nil {
				return err
			}
			if err := e.download(cmd, ent.GetPath(), dst, user, fs.FileMode(ent.GetMode()), force, false); err != nil {
				return err
			}
			n++
		}
	}
	fmt.Fprintf(cmd.OutOrStdout(), "downloaded %d files and %d symlinks from %s:%s to %s\n", n, links, e.id, remote, local)
	return nil
}

// downloadLink recreates a sandbox symlink locally. envd reports where a link resolves to (as
// E2B's does), not its text: a target inside the downloaded directory becomes a relative link
// to its local copy, any other one an absolute link to the same path.
func downloadLink(ent *filesystem.EntryInfo, base, local, dst string, force bool) error {
	target := ent.GetSymlinkTarget()
	if rel, ok := strings.CutPrefix(target, base+"/"); ok {
		t, err := filepath.Rel(filepath.Dir(dst), filepath.Join(local, filepath.FromSlash(rel)))
		if err != nil {
			return err
		}
		target = t
	}
	if err := os.MkdirAll(filepath.Dir(dst), 0o755); err != nil {
		return err
	}
	if _, err := os.Lstat(dst); err == nil {
		if !force {
			return fmt.Errorf("%s exists; pass --force to overwrite it", dst)
		}
		if err := os.Remove(dst); err != nil {
			return err
		}
	}
	return os.Symlink(target, dst)
}
