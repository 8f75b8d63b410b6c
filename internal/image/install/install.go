// Package install turns an image reference into a registered template on
// this node: pull, unpack into <data-dir>/templates/<id>/rootfs,
// optionally convert to overlaybd layers, and record it in the catalog. It
// is what `aenv pull` runs against a stopped node's data directory, and what
// a server-side build job can run with the node's open catalog.
package install

import (
	"context"
	"crypto/rand"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"path"
	"path/filepath"
	"regexp"
	"strings"

	"github.com/aenv-dev/aenv/internal/catalog"
	"github.com/aenv-dev/aenv/internal/image"
	"github.com/aenv-dev/aenv/internal/image/convert"
	"github.com/aenv-dev/aenv/internal/sandbox"
)

// Templates is the catalog part install uses (*catalog.Templates).
type Templates interface {
	Resolve(idOrAlias string) (catalog.Template, error)
	Put(t catalog.Template) error
}

// Request describes one install.
type Request struct {
	Ref     string
	DataDir string
	// Name is the template's alias; default: the image's repository leaf.
	Name string
	// ID is the template id; default: random.
	ID             string
	Resources      sandbox.Resources
	StartCmd       string
	ReadyCmd       string
	StartFromImage bool
	// User is the template's default user (an account name or uid of the image);
	// default: the image's USER, as builds do, or DefaultUser when it has none. The
	// account DefaultUser (home /home/user) is made sure to exist either way.
	User string
	// Log receives warnings (default slog.Default()).
	Log *slog.Logger
	// Convert also converts the image into overlaybd layers (root only) at
	// Resources.DiskSizeMB (default DefaultDiskMB) and keeps them in the
	// template's artifact.
	Convert  bool
	Pull     image.Options
	Progress image.ProgressFunc
}

// ErrUnknownUser means the requested default user has no account in the image.
var ErrUnknownUser = errors.New("unknown user")

// DefaultDiskMB is the ext4 size used for conversion when none is given.
const DefaultDiskMB = 4096

// Paths under the data directory.
const (
	ImagesDir    = "images"
	OverlaybdDir = "images/overlaybd"
	TemplatesDir = "templates"
)

// Run performs the install and returns the registered template. On error
// nothing is registered and the template directory is removed (cached
// layer blobs and converted layers stay: they are content-addressed).
func Run(ctx context.Context, ts Templates, r Request) (catalog.Template, error) {
	if r.DataDir == "" {
		return catalog.Template{}, errors.New("install: DataDir is required")
	}
	src, err := image.ParseReference(r.Ref)
	if err != nil {
		return catalog.Template{}, err
	}
	if r.Name == "" {
		r.Name = DefaultName(src)
	}
	if !catalog.ValidName(r.Name) {
		return catalog.Template{}, fmt.Errorf("%w: template name %q (letters, digits, '.', '_', '-')", catalog.ErrInvalid, r.Name)
	}
	if t, err := ts.Resolve(r.Name); err == nil {
		return catalog.Template{}, fmt.Errorf("%w: template %q already exists (id %s); remove it first or pick another --name", catalog.ErrAliasTaken, r.Name, t.ID)
	} else if !errors.Is(err, catalog.ErrNotFound) {
		return catalog.Template{}, err
	}
	if r.ID == "" {
		r.ID = NewID()
	}
	img, err := image.Pull(ctx, r.Ref, r.Pull)
	if err != nil {
		return catalog.Template{}, err
	}
	defer img.Close()
	store := &image.Store{Dir: filepath.Join(r.DataDir, ImagesDir)}
	dir := filepath.Join(r.DataDir, TemplatesDir, r.ID)
	built, err := image.BuildTemplate(ctx, img, dir, image.BuildOptions{Store: store, Progress: r.Progress})
	if err != nil {
		return catalog.Template{}, err
	}
	ok := false
	defer func() {
		if !ok {
			os.RemoveAll(dir)
		}
	}()
	user, err := defaultUser(built, r)
	if err != nil {
		return catalog.Template{}, err
	}
	var obd *catalog.LayerStack
	if r.Convert {
		size := r.Resources.DiskSizeMB
		if size == 0 {
			size = DefaultDiskMB
		}
		res, err := convert.Convert(ctx, img, convert.Options{Store: store, Dir: filepath.Join(r.DataDir, OverlaybdDir),
			SizeMB: size, Progress: r.Progress, User: image.DefaultUser})
		if err != nil {
			return catalog.Template{}, err
		}
		obd = res.Stack()
	}
	t, err := image.Register(ts, built, image.RegisterOptions{ID: r.ID, Alias: r.Name, Resources: r.Resources,
		StartCmd: r.StartCmd, ReadyCmd: r.ReadyCmd, StartFromImage: r.StartFromImage, User: user, Overlaybd: obd})
	if err != nil {
		return catalog.Template{}, err
	}
	ok = true
	return t, nil
}

// defaultUser picks the template's default user the way builds do: the requested one,
// else the image's USER resolved to its account name; an image USER without an account
// falls back to DefaultUser with a warning, a requested one is an error.
func defaultUser(b *image.Built, r Request) (string, error) {
	want, requested := r.User, r.User != ""
	if !requested {
		want = b.Image.Config.User
	}
	if want == "" {
		return b.User, nil
	}
	name, ok, err := image.AccountName(b.RootFS, want)
	if err != nil {
		return "", fmt.Errorf("install: default user: %w", err)
	}
	switch {
	case ok:
		return name, nil
	case requested:
		return "", fmt.Errorf("%w: %q has no account in the image's /etc/passwd", ErrUnknownUser, want)
	}
	log := r.Log
	if log == nil {
		log = slog.Default()
	}
	log.Warn("the image's USER has no account in /etc/passwd; the default user is "+b.User, "ref", r.Ref, "user", want)
	return b.User, nil
}

var nameJunk = regexp.MustCompile(`[^A-Za-z0-9._-]+`)

// DefaultName is the template name for an image: its repository's last path
// element ("ubuntu" for docker.io/library/ubuntu:22.04), or the layout or
// archive file's base name.
func DefaultName(s image.Source) string {
	n := s.Path
	if s.Transport == image.Registry {
		n = s.Ref
		if i := strings.IndexByte(n, '@'); i >= 0 {
			n = n[:i]
		}
		if i := strings.LastIndexByte(n, ':'); i > strings.LastIndexByte(n, '/') {
			n = n[:i]
		}
	}
	n = path.Base(strings.TrimSuffix(filepath.ToSlash(n), "/"))
	n = strings.TrimSuffix(strings.TrimSuffix(n, ".tar"), ".tgz")
	n = strings.Trim(nameJunk.ReplaceAllString(n, "-"), "-._")
	if n == "" {
		n = "image"
	}
	return n
}

// NewID returns a random template id (20 lowercase letters and digits, like E2B's).
func NewID() string {
	const alphabet = "abcdefghijklmnopqrstuvwxyz0123456789"
	b := make([]byte, 20)
	rand.Read(b)
	for i := range b {
		b[i] = alphabet[int(b[i])%len(alphabet)]
	}
	return string(b)
}
