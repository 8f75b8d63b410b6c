// Package debian makes OCI images from a minimal Debian root for tests: debootstrap
// --variant=minbase, built once per machine and cached by scripts/debian-root.sh. Such a
// root is what public images look like (usr-merged, dynamic glibc binaries, no `user`
// account), unlike the busybox images most tests use.
package debian

import (
	"archive/tar"
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strings"
	"syscall"

	"github.com/google/go-containerregistry/pkg/name"
	v1 "github.com/google/go-containerregistry/pkg/v1"
	"github.com/google/go-containerregistry/pkg/v1/empty"
	"github.com/google/go-containerregistry/pkg/v1/mutate"
	"github.com/google/go-containerregistry/pkg/v1/remote"
	"github.com/google/go-containerregistry/pkg/v1/static"
	"github.com/google/go-containerregistry/pkg/v1/types"
)

// ErrUnavailable means this host cannot build the root (not root, or no debootstrap).
var ErrUnavailable = errors.New("a Debian root cannot be built here")

// Root returns the cached minimal Debian root, building it the first time on this machine
// (about 1.5 min; concurrent callers wait for one build). repo is the checkout's root.
func Root(ctx context.Context, repo string) (string, error) {
	if os.Geteuid() != 0 {
		return "", fmt.Errorf("%w: needs root", ErrUnavailable)
	}
	if _, err := exec.LookPath("debootstrap"); err != nil {
		return "", fmt.Errorf("%w: needs debootstrap (scripts/deps.sh installs it)", ErrUnavailable)
	}
	var stderr bytes.Buffer
	cmd := exec.CommandContext(ctx, filepath.Join(repo, "scripts", "debian-root.sh"))
	cmd.Stderr = &stderr
	out, err := cmd.Output()
	if err != nil {
		return "", fmt.Errorf("scripts/debian-root.sh: %w: %s", err, stderr.Bytes())
	}
	return strings.TrimSpace(string(out)), nil
}

// Image names Images makes.
const (
	// Plain is the root as one layer: no `user` account, no USER.
	Plain = "debian:bookworm"
	// WithUser adds a layer with the account app (uid 1001, home /home/app) and USER app.
	WithUser = "debian:app"
	// BareUID has USER 12345, a uid without an account, as some images do.
	BareUID = "debian:uid"
)

// AppUID is the uid of WithUser's account app.
const AppUID = 1001

// Images makes the test images from root (see Plain, WithUser, BareUID). Layers are
// uncompressed, so nothing is spent compressing the root.
func Images(root string) (map[string]v1.Image, error) {
	tr, err := TarDir(root)
	if err != nil {
		return nil, err
	}
	base, err := mutate.AppendLayers(empty.Image, static.NewLayer(tr, types.OCIUncompressedLayer))
	if err != nil {
		return nil, err
	}
	passwd, err := os.ReadFile(filepath.Join(root, "etc/passwd"))
	if err != nil {
		return nil, err
	}
	group, err := os.ReadFile(filepath.Join(root, "etc/group"))
	if err != nil {
		return nil, err
	}
	app, err := appLayer(string(passwd), string(group))
	if err != nil {
		return nil, err
	}
	withApp, err := mutate.AppendLayers(base, static.NewLayer(app, types.OCIUncompressedLayer))
	if err != nil {
		return nil, err
	}
	out := map[string]v1.Image{}
	for n, c := range map[string]struct {
		img  v1.Image
		user string
	}{Plain: {base, ""}, WithUser: {withApp, "app"}, BareUID: {base, "12345"}} {
		if out[n], err = configure(c.img, c.user); err != nil {
			return nil, err
		}
	}
	return out, nil
}

func configure(img v1.Image, user string) (v1.Image, error) {
	cf, err := img.ConfigFile()
	if err != nil {
		return nil, err
	}
	cf = cf.DeepCopy()
	cf.OS, cf.Architecture = "linux", runtime.GOARCH
	cf.Config = v1.Config{User: user, Cmd: []string{"bash"},
		Env: []string{"PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"}}
	return mutate.ConfigFile(mutate.MediaType(img, types.OCIManifestSchema1), cf)
}

// Push writes images to the registry at host (plain HTTP, a loopback test registry).
func Push(host string, imgs map[string]v1.Image) (map[string]string, error) {
	refs := map[string]string{}
	for n, img := range imgs {
		ref, err := name.ParseReference(host+"/"+n, name.Insecure)
		if err != nil {
			return nil, err
		}
		if err := remote.Write(ref, img); err != nil {
			return nil, fmt.Errorf("push %s: %w", ref, err)
		}
		refs[n] = ref.String()
	}
	return refs, nil
}

// appLayer adds the account app with its home, as `useradd -m app` would.
func appLayer(passwd, group string) ([]byte, error) {
	var buf bytes.Buffer
	tw := tar.NewWriter(&buf)
	files := []struct {
		name, body string
		mode       int64
	}{
		{"etc/passwd", passwd + fmt.Sprintf("app:x:%d:%d::/home/app:/bin/bash\n", AppUID, AppUID), 0o644},
		{"etc/group", group + fmt.Sprintf("app:x:%d:\n", AppUID), 0o644},
	}
	for _, f := range files {
		if err := tw.WriteHeader(&tar.Header{Name: f.name, Mode: f.mode, Size: int64(len(f.body)), Typeflag: tar.TypeReg}); err != nil {
			return nil, err
		}
		if _, err := tw.Write([]byte(f.body)); err != nil {
			return nil, err
		}
	}
	if err := tw.WriteHeader(&tar.Header{Name: "home/app/", Mode: 0o750, Typeflag: tar.TypeDir, Uid: AppUID, Gid: AppUID}); err != nil {
		return nil, err
	}
	if err := tw.Close(); err != nil {
		return nil, err
	}
	return buf.Bytes(), nil
}

// TarDir tars a directory tree as an image layer: numeric ownership, modes, hard links as
// links, and nothing below /dev, /proc and /sys (runtimes mount over them).
func TarDir(dir string) ([]byte, error) {
	var buf bytes.Buffer
	tw := tar.NewWriter(&buf)
	seen := map[uint64]string{}
	err := filepath.WalkDir(dir, func(p string, d fs.DirEntry, err error) error {
		if err != nil || p == dir {
			return err
		}
		rel := filepath.ToSlash(strings.TrimPrefix(p, dir+"/"))
		if top, _, nested := strings.Cut(rel, "/"); nested && (top == "dev" || top == "proc" || top == "sys") {
			if d.IsDir() {
				return fs.SkipDir
			}
			return nil
		}
		fi, err := os.Lstat(p)
		if err != nil {
			return err
		}
		link := ""
		if fi.Mode()&fs.ModeSymlink != 0 {
			if link, err = os.Readlink(p); err != nil {
				return err
			}
		}
		h, err := tar.FileInfoHeader(fi, link)
		if err != nil {
			return err
		}
		h.Name, h.Uname, h.Gname = rel, "", ""
		st := fi.Sys().(*syscall.Stat_t)
		h.Uid, h.Gid = int(st.Uid), int(st.Gid)
		if fi.Mode().IsRegular() && st.Nlink > 1 {
			if first, ok := seen[st.Ino]; ok {
				h.Typeflag, h.Linkname, h.Size = tar.TypeLink, first, 0
				return tw.WriteHeader(h)
			}
			seen[st.Ino] = rel
		}
		if err := tw.WriteHeader(h); err != nil {
			return err
		}
		if !fi.Mode().IsRegular() {
			return nil
		}
		f, err := os.Open(p)
		if err != nil {
			return err
		}
		defer f.Close()
		_, err = io.Copy(tw, f)
		return err
	})
	if err != nil {
		return nil, err
	}
	if err := tw.Close(); err != nil {
		return nil, err
	}
	return buf.Bytes(), nil
}
