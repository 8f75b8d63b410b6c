package build

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"path/filepath"
	"regexp"
	"strings"

	"github.com/aenv-dev/aenv/internal/catalog"
	"github.com/aenv-dev/aenv/internal/image/install"
	"github.com/aenv-dev/aenv/internal/image/unpack"
	"github.com/aenv-dev/aenv/internal/orchestrator"
)

// Capturer turns a finished build sandbox into the new template's root filesystem.
//
// The Service snapshots build sandboxes that run on layered roots (snapshotCapture, see
// layers.go). TarCapture is the fallback for directory templates and backends that
// cannot snapshot: it streams the sandbox's root out through envd.
type Capturer interface {
	// Capture stores the sandbox's filesystem under dir (which it creates; dir must not
	// exist) and says how the template refers to it. On error dir is left absent.
	Capture(ctx context.Context, s *Session, dir string, logf func(level, msg string)) (Captured, error)
}

// Captured is a template's storage as a Capturer produced it.
type Captured struct {
	// RootFSDir is an unpacked root filesystem (directory templates).
	RootFSDir string
	// Artifact is stored verbatim as the catalog template's artifact.
	Artifact json.RawMessage
	// Layers is a layered capture (snapshotCapture): the template's stack, with the
	// backend capture that owns the new layer. RootFSDir and Artifact are then empty.
	Layers *LayersArtifact
}

// captureScript archives the sandbox's root to stdout, leaving out the kernel and
// runtime mounts and the envd mount point: their content is not the template's. It
// names the top-level entries itself because busybox tar (Debian's) has no --exclude.
const captureScript = `cd / || exit 2
set --
for f in .[!.]* ..?* *; do
  case "$f" in proc|sys|dev|.aenv) continue ;; esac
  if [ -e "$f" ] || [ -L "$f" ]; then set -- "$@" "$f"; fi
done
exec tar -c -f - "$@"`

// runtimeLeftovers are paths envd and the runtime write at start that a template must
// not carry (rootfs-relative).
var runtimeLeftovers = []string{"run/e2b"}

// benignTar matches GNU tar's warnings that leave a complete archive (exit status 1).
var benignTar = regexp.MustCompile(`(?m)^tar: .*(file changed as we read it|socket ignored)$`)

// TarCapture materialises the build sandbox's merged root (template lower plus the
// sandbox's upper, as the sandbox sees it) into dir/rootfs by running tar as root inside
// the sandbox and unpacking the stream on the host. It works on any backend that runs
// envd, needs tar in the image, and is replaced by a snapshot capture where the backend
// has one.
type TarCapture struct{}

// RootFSName is the rootfs directory inside a captured template directory.
const RootFSName = "rootfs"

// Capture implements Capturer.
func (TarCapture) Capture(ctx context.Context, s *Session, dir string, logf func(level, msg string)) (Captured, error) {
	if _, err := os.Lstat(dir); err == nil {
		return Captured{}, fmt.Errorf("capture: %s already exists", dir)
	}
	if err := os.MkdirAll(filepath.Dir(dir), 0o755); err != nil {
		return Captured{}, fmt.Errorf("capture: %w", err)
	}
	tmp, err := os.MkdirTemp(filepath.Dir(dir), "."+filepath.Base(dir)+".tmp-")
	if err != nil {
		return Captured{}, fmt.Errorf("capture: %w", err)
	}
	ok := false
	defer func() {
		if !ok {
			os.RemoveAll(tmp)
		}
	}()
	if err := os.Chmod(tmp, 0o755); err != nil {
		return Captured{}, err
	}
	rootfs := filepath.Join(tmp, RootFSName)
	if err := os.Mkdir(rootfs, 0o755); err != nil {
		return Captured{}, err
	}
	pr, pw := io.Pipe()
	type result struct {
		stats unpack.Stats
		err   error
	}
	done := make(chan result, 1)
	go func() {
		st, err := unpack.Apply(ctx, rootfs, pr, unpack.Options{})
		// Drain what is left so the stream's writer never blocks on a failed unpack.
		io.Copy(io.Discard, pr)
		done <- result{st, err}
	}()
	var stderr bytes.Buffer
	runErr := s.Run(ctx, Command{Argv: []string{"/bin/sh", "-c", captureScript}, User: "root", Dir: "/",
		Stdout: pw, Stderr: &limitedBuffer{b: &stderr, n: 64 << 10}})
	pw.Close()
	res := <-done
	msg := strings.TrimSpace(stderr.String())
	var exit *ExitError
	switch {
	case res.err != nil:
		return Captured{}, fmt.Errorf("capture: unpack the sandbox root: %w (tar: %s)", res.err, msg)
	case errors.As(runErr, &exit) && exit.Code == 127:
		return Captured{}, fmt.Errorf("capture: the image has no tar, which the capture needs (%s)", msg)
	case errors.As(runErr, &exit) && exit.Code == 1 && msg != "" && strings.TrimSpace(benignTar.ReplaceAllString(msg, "")) == "":
		// GNU tar: files changed while read, sockets skipped; the archive is whole.
		logf("warn", "capture: tar reported: "+msg)
	case runErr != nil:
		return Captured{}, fmt.Errorf("capture: tar in the sandbox: %w: %s", runErr, msg)
	}
	if res.stats.Entries == 0 {
		return Captured{}, fmt.Errorf("capture: tar produced an empty archive (%s)", msg)
	}
	for _, p := range runtimeLeftovers {
		if err := os.RemoveAll(filepath.Join(rootfs, p)); err != nil {
			return Captured{}, fmt.Errorf("capture: %w", err)
		}
	}
	if err := mountPoints(rootfs); err != nil {
		return Captured{}, fmt.Errorf("capture: %w", err)
	}
	if err := os.Rename(tmp, dir); err != nil {
		return Captured{}, fmt.Errorf("capture: %w", err)
	}
	ok = true
	art, _ := json.Marshal(map[string]string{"kind": "build-rootfs"})
	return Captured{RootFSDir: filepath.Join(dir, RootFSName), Artifact: art}, nil
}

// mountPoints recreates what captureExcludes left out and what sandboxes mount over:
// kernel filesystems, the envd mount point and the files the runtime binds.
func mountPoints(rootfs string) error {
	r, err := os.OpenRoot(rootfs)
	if err != nil {
		return err
	}
	defer r.Close()
	for _, d := range []struct {
		p    string
		mode fs.FileMode
	}{{"proc", 0o555}, {"sys", 0o555}, {"dev", 0o755}, {".aenv", 0o755}, {"etc", 0o755}, {"tmp", 0o777 | fs.ModeSticky}, {"run", 0o755}} {
		if _, err := r.Lstat(d.p); errors.Is(err, fs.ErrNotExist) {
			if err := r.Mkdir(d.p, 0o755); err != nil {
				return err
			}
			if err := r.Chmod(d.p, d.mode); err != nil {
				return err
			}
		}
	}
	for _, f := range []struct {
		p    string
		mode fs.FileMode
	}{{".aenv/envd", 0o755}, {"etc/hosts", 0o644}, {"etc/resolv.conf", 0o644}, {"etc/hostname", 0o644}} {
		if _, err := r.Lstat(f.p); errors.Is(err, fs.ErrNotExist) {
			if err := r.WriteFile(f.p, nil, f.mode); err != nil {
				return err
			}
		}
	}
	return nil
}

// limitedBuffer keeps the first n bytes written and discards the rest.
type limitedBuffer struct {
	b *bytes.Buffer
	n int
}

func (l *limitedBuffer) Write(p []byte) (int, error) {
	if room := l.n - l.b.Len(); room > 0 {
		l.b.Write(p[:min(room, len(p))])
	}
	return len(p), nil
}

// removeFiles deletes a deleted template's build directories that no sandbox uses:
// removing files under a live overlay's lower would change running sandboxes.
func (s *Service) removeFiles(ctx context.Context, t catalog.Template) {
	root := filepath.Join(s.cfg.DataDir, install.TemplatesDir, t.ID)
	if !strings.HasPrefix(t.RootFSDir, filepath.Join(root, "builds")+"/") {
		return // not made by a build (a pulled image, the base template): not ours to remove
	}
	if s.pruneBuilds(ctx, t.ID, "") == 0 {
		os.RemoveAll(root)
	}
}

// pruneBuilds removes the build directories of a template except keep and those that
// sandboxes still run on, and returns how many it kept.
func (s *Service) pruneBuilds(ctx context.Context, templateID, keep string) int {
	dir := filepath.Join(s.cfg.DataDir, install.TemplatesDir, templateID, "builds")
	sbs, err := s.listSandboxes(ctx)
	if err != nil {
		s.log.Warn("list sandboxes; keeping the template's files", "template", templateID, "err", err)
		return -1
	}
	inUse := map[string]bool{}
	for _, sb := range sbs {
		inUse[sb.Launch.RootFS.LowerDir] = true
	}
	ents, _ := os.ReadDir(dir)
	kept := 0
	for _, e := range ents {
		d := filepath.Join(dir, e.Name())
		r, known := s.store.get(e.Name())
		building := known && r.Status == StatusBuilding // a concurrent build of the same template
		if e.Name() == keep || building || inUse[filepath.Join(d, RootFSName)] || strings.HasPrefix(e.Name(), ".") {
			kept++
			continue
		}
		if err := os.RemoveAll(d); err != nil {
			s.log.Warn("remove template files", "template", templateID, "dir", d, "err", err)
			kept++
		}
	}
	if kept > 0 && keep == "" {
		s.log.Info("kept template files still used by sandboxes", "template", templateID, "builds", kept)
	}
	return kept
}

// listSandboxes lists every sandbox of the node, page after page.
func (s *Service) listSandboxes(ctx context.Context) ([]*orchestrator.Sandbox, error) {
	var all []*orchestrator.Sandbox
	for tok := ""; ; {
		items, next, err := s.sbx.List(ctx, orchestrator.ListFilter{NextToken: tok, Limit: orchestrator.MaxListLimit})
		if err != nil {
			return nil, err
		}
		all = append(all, items...)
		if next == "" {
			return all, nil
		}
		tok = next
	}
}
