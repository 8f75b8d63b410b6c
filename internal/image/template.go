package image

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"time"

	"github.com/aenv-dev/aenv/internal/image/unpack"
)

// Files inside a template directory built by BuildTemplate.
const (
	RootFSName = "rootfs"
	ConfigName = "image.json"
)

// ErrExists means the template directory is already there.
var ErrExists = errors.New("template directory already exists")

// BuildOptions tune BuildTemplate.
type BuildOptions struct {
	// Store caches layer blobs. Required.
	Store *Store
	// Progress receives download and apply reports; may be nil.
	Progress ProgressFunc
	// User is the account made sure to exist (default DefaultUser, whose
	// home is /home/<User>).
	User string
	// MinFree is the disk space unpacking keeps free on dir's filesystem (default
	// DefaultMinFree; negative: no check): an image too big for the node's disk fails
	// instead of filling the disk the node's catalog and sandboxes live on.
	MinFree int64
}

// DefaultMinFree is BuildOptions.MinFree's default.
const DefaultMinFree = 512 << 20

// Built is an image unpacked into a template directory.
type Built struct {
	Dir     string `json:"-"`
	RootFS  string `json:"-"`
	Image   Image  `json:"image"`
	User    string `json:"user"`
	UserUID int    `json:"userUID"`
	// Bytes is the total uncompressed layer data applied.
	Bytes   int64     `json:"bytes"`
	BuiltAt time.Time `json:"builtAt"`
}

// BuildTemplate fetches img's layers into the store and unpacks them, in
// order, into dir/rootfs; makes sure the default user exists and the mount
// points sandboxes need are there; and writes the image configuration to
// dir/image.json. It builds in a temporary sibling and renames it into
// place, so dir is either complete or absent; dir must not exist.
func BuildTemplate(ctx context.Context, img *Image, dir string, o BuildOptions) (*Built, error) {
	if o.Store == nil {
		return nil, errors.New("image: BuildOptions.Store is required")
	}
	if o.User == "" {
		o.User = DefaultUser
	}
	if o.MinFree == 0 {
		o.MinFree = DefaultMinFree
	}
	progress := o.Progress
	if progress == nil {
		progress = func(Progress) {}
	}
	if _, err := os.Lstat(dir); err == nil {
		return nil, fmt.Errorf("%w: %s", ErrExists, dir)
	}
	if err := o.Store.Fetch(ctx, img, progress); err != nil {
		return nil, err
	}
	if err := os.MkdirAll(filepath.Dir(dir), 0o755); err != nil {
		return nil, err
	}
	tmp, err := os.MkdirTemp(filepath.Dir(dir), "."+filepath.Base(dir)+".tmp-")
	if err != nil {
		return nil, err
	}
	ok := false
	defer func() {
		if !ok {
			os.RemoveAll(tmp)
		}
	}()
	if err := os.Chmod(tmp, 0o755); err != nil {
		return nil, err
	}
	rootfs := filepath.Join(tmp, RootFSName)
	if err := os.Mkdir(rootfs, 0o755); err != nil {
		return nil, err
	}
	b := &Built{Image: *img, User: o.User}
	b.Image.img, b.Image.cleanups = nil, nil
	for n, l := range img.Layers {
		applied, err := applyLayer(ctx, o.Store, l, rootfs, unpack.Options{MinFree: max(o.MinFree, 0)})
		if err != nil {
			return nil, fmt.Errorf("layer %d (%s): %w", n+1, l.Digest, err)
		}
		b.Bytes += applied
		progress(Progress{Phase: PhaseApply, Layer: n + 1, Layers: len(img.Layers), Digest: l.Digest,
			Done: applied, Total: applied, Final: true})
	}
	uid, err := PrepareRootFS(rootfs, o.User)
	if err != nil {
		return nil, err
	}
	b.UserUID = uid
	b.BuiltAt = time.Now().UTC()
	raw, err := json.MarshalIndent(b, "", "  ")
	if err != nil {
		return nil, err
	}
	if err := os.WriteFile(filepath.Join(tmp, ConfigName), append(raw, '\n'), 0o644); err != nil {
		return nil, err
	}
	if err := os.Rename(tmp, dir); err != nil {
		return nil, fmt.Errorf("put template in place: %w", err)
	}
	ok = true
	b.Dir, b.RootFS = dir, filepath.Join(dir, RootFSName)
	return b, nil
}

// ApplyLayer applies one cached layer onto the directory root (an unpacked
// rootfs, or a mounted filesystem being converted) and verifies its diff id.
// It returns the uncompressed bytes read.
func ApplyLayer(ctx context.Context, s *Store, l Layer, root string) (int64, error) {
	return applyLayer(ctx, s, l, root, unpack.Options{})
}

func applyLayer(ctx context.Context, s *Store, l Layer, root string, o unpack.Options) (int64, error) {
	rc, err := s.OpenLayer(l)
	if err != nil {
		return 0, err
	}
	_, aerr := unpack.Apply(ctx, root, rc, o)
	verr := rc.Close()
	n := rc.(*verifiedReader).Size()
	if verr != nil {
		// A corrupt stream usually makes the tar reader fail too; the
		// digest error says what actually went wrong.
		return n, verr
	}
	return n, aerr
}

// LoadBuilt reads the description BuildTemplate wrote into dir.
func LoadBuilt(dir string) (*Built, error) {
	raw, err := os.ReadFile(filepath.Join(dir, ConfigName))
	if err != nil {
		if errors.Is(err, fs.ErrNotExist) {
			return nil, fmt.Errorf("%s is not a built image template: %w", dir, err)
		}
		return nil, err
	}
	b := &Built{}
	if err := json.Unmarshal(raw, b); err != nil {
		return nil, fmt.Errorf("%s: %w", filepath.Join(dir, ConfigName), err)
	}
	b.Dir, b.RootFS = dir, filepath.Join(dir, RootFSName)
	return b, nil
}
