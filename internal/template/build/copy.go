package build

import (
	"archive/tar"
	"bufio"
	"bytes"
	"compress/gzip"
	"errors"
	"fmt"
	"io"
	"path"
	"strconv"
	"strings"
	"time"
)

// copyPlan says where the entries of an uploaded tar go in the build sandbox.
type copyPlan struct {
	src      string // the COPY source as given: a context-relative path or glob
	dest     string // absolute destination
	destDir  bool   // dest names a directory (ends in / or exists as one)
	uid, gid int
	mode     int64 // 0: keep the uploaded modes
}

// openUpload returns a tar reader over an uploaded file set, gzip or not (the SDKs
// gzip by default; `copy(..., {gzip: false})` does not).
func openUpload(r io.Reader) (*tar.Reader, error) {
	br := bufio.NewReader(r)
	magic, _ := br.Peek(2)
	if bytes.Equal(magic, []byte{0x1f, 0x8b}) {
		zr, err := gzip.NewReader(br)
		if err != nil {
			return nil, fmt.Errorf("uploaded files: %w", err)
		}
		return tar.NewReader(zr), nil
	}
	return tar.NewReader(br), nil
}

// hasGlob reports whether p has glob metacharacters (the SDKs expand COPY sources as globs).
func hasGlob(p string) bool { return strings.ContainsAny(p, "*?[") }

// target maps an uploaded entry (context-relative, cleaned) to its path in the sandbox,
// with Docker's COPY rules: a directory source copies its contents into dest; a file
// goes to dest, or into it when dest is a directory; every glob match goes into dest.
// ok is false for entries the source does not select.
func (p copyPlan) target(name string, isDir bool) (string, bool) {
	src := strings.TrimSuffix(path.Clean(p.src), "/")
	var top string
	if hasGlob(src) {
		k := len(strings.Split(src, "/"))
		if strings.Contains(src, "**") {
			return "", false
		}
		parts := strings.Split(name, "/")
		if len(parts) < k {
			return "", false
		}
		top = strings.Join(parts[:k], "/")
		if ok, _ := path.Match(src, top); !ok {
			return "", false
		}
		if top == name && !isDir {
			return path.Join(p.dest, path.Base(name)), true
		}
		// A matched directory: its contents go into dest (Docker), it does not itself.
		if top == name {
			return "", false
		}
		return path.Join(p.dest, strings.TrimPrefix(name, top+"/")), true
	}
	top = src
	switch {
	case src == ".":
		if name == "." {
			return p.dest, true
		}
		return path.Join(p.dest, name), true
	case name == top && !isDir:
		if p.destDir {
			return path.Join(p.dest, path.Base(name)), true
		}
		return p.dest, true
	case name == top:
		return p.dest, true
	case strings.HasPrefix(name, top+"/"):
		return path.Join(p.dest, strings.TrimPrefix(name, top+"/")), true
	}
	return "", false
}

// rewriteCopy turns an uploaded tar into one whose entries are named by their
// destination (relative to /), owned by the plan's uid/gid and with its mode, so the
// sandbox only has to `tar -x -C /`. It refuses entries that would escape the context
// and reports how many entries were selected.
func rewriteCopy(upload io.Reader, p copyPlan, out io.Writer) (int, error) {
	tr, err := openUpload(upload)
	if err != nil {
		return 0, err
	}
	tw := tar.NewWriter(out)
	moved := map[string]string{} // uploaded name -> destination, for hard links
	n := 0
	if p.destDir {
		// The destination directory itself belongs to the owner, as Docker's --chown and
		// E2B's copy do for directories they create.
		if err := tw.WriteHeader(&tar.Header{Typeflag: tar.TypeDir, Name: strings.TrimPrefix(p.dest, "/") + "/",
			Mode: 0o755, Uid: p.uid, Gid: p.gid, ModTime: time.Now()}); err != nil {
			return 0, err
		}
	}
	for {
		h, err := tr.Next()
		if errors.Is(err, io.EOF) {
			break
		}
		if err != nil {
			return n, fmt.Errorf("uploaded files: %w", err)
		}
		name := path.Clean(strings.TrimPrefix(h.Name, "./"))
		if path.IsAbs(name) || name == ".." || strings.HasPrefix(name, "../") {
			return n, fmt.Errorf("uploaded files: entry %q leaves the build context", h.Name)
		}
		switch h.Typeflag {
		case tar.TypeReg, tar.TypeDir, tar.TypeSymlink, tar.TypeLink:
		case tar.TypeXGlobalHeader, tar.TypeXHeader:
			continue
		default:
			return n, fmt.Errorf("uploaded files: %q is a device, fifo or other special file", h.Name)
		}
		to, ok := p.target(name, h.Typeflag == tar.TypeDir)
		if !ok {
			continue
		}
		if to == "/" {
			continue // never re-own the root directory
		}
		moved[name] = to
		nh := &tar.Header{Typeflag: h.Typeflag, Name: strings.TrimPrefix(to, "/"), Mode: h.Mode & 0o7777,
			Uid: p.uid, Gid: p.gid, ModTime: h.ModTime, Linkname: h.Linkname, Size: h.Size}
		if h.Typeflag == tar.TypeDir {
			nh.Name += "/"
		}
		if p.mode != 0 && h.Typeflag != tar.TypeSymlink {
			nh.Mode = p.mode
		}
		if h.Typeflag == tar.TypeLink {
			dst, ok := moved[path.Clean(strings.TrimPrefix(h.Linkname, "./"))]
			if !ok {
				return n, fmt.Errorf("uploaded files: hard link %q points outside the copied files", h.Name)
			}
			nh.Linkname, nh.Size = strings.TrimPrefix(dst, "/"), 0
		}
		if err := tw.WriteHeader(nh); err != nil {
			return n, err
		}
		if h.Typeflag == tar.TypeReg {
			if _, err := io.Copy(tw, tr); err != nil {
				return n, fmt.Errorf("uploaded files: %s: %w", h.Name, err)
			}
		}
		n++
	}
	if n == 0 {
		return 0, fmt.Errorf("no uploaded files match %q", p.src)
	}
	return n, tw.Close()
}

// lookupOwner resolves "user[:group]" (names or numbers) against passwd and group file
// contents; a user without a group gets its primary group.
func lookupOwner(owner string, passwd, group []byte) (uid, gid int, err error) {
	u, g, hasGroup := strings.Cut(owner, ":")
	uid, gid, found := -1, -1, false
	if n, err := strconv.Atoi(u); err == nil {
		uid, found = n, true
	}
	for _, line := range strings.Split(string(passwd), "\n") {
		f := strings.Split(line, ":")
		if len(f) < 4 {
			continue
		}
		if f[0] == u || (found && f[2] == u) {
			uid, _ = strconv.Atoi(f[2])
			gid, _ = strconv.Atoi(f[3])
			found = true
			break
		}
	}
	if !found {
		return 0, 0, fmt.Errorf("user %q does not exist in the build sandbox", u)
	}
	if !hasGroup {
		if gid < 0 {
			gid = uid
		}
		return uid, gid, nil
	}
	if n, err := strconv.Atoi(g); err == nil {
		return uid, n, nil
	}
	for _, line := range strings.Split(string(group), "\n") {
		f := strings.Split(line, ":")
		if len(f) >= 3 && f[0] == g {
			gid, _ = strconv.Atoi(f[2])
			return uid, gid, nil
		}
	}
	return 0, 0, fmt.Errorf("group %q does not exist in the build sandbox", g)
}
