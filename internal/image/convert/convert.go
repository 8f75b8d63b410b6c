// Package convert turns an OCI image into overlaybd layers with the storage
// engine: the bottom layer is an empty ext4 filesystem made by mkfs.ext4 at
// the disk size, and each OCI layer becomes one sealed layer on top of its
// parent (stack mounted through FUSE + loop, ext4 mounted, the layer tar
// applied, unmounted, sealed, compressed with ZFile). Converted layers are
// cached by the chain of diff ids beneath them (and the disk size), so
// images that share base layers convert them once.
package convert

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"os"
	"path/filepath"
	"strings"
	"time"

	"github.com/aenv-dev/aenv/internal/catalog"
	"github.com/aenv-dev/aenv/internal/dirlock"
	"github.com/aenv-dev/aenv/internal/sandbox"

	"golang.org/x/sys/unix"

	"github.com/aenv-dev/aenv/internal/image"
	"github.com/aenv-dev/aenv/internal/storage/blob"
	"github.com/aenv-dev/aenv/internal/storage/blockdev"
	"github.com/aenv-dev/aenv/internal/storage/lsmt"
	"github.com/aenv-dev/aenv/internal/storage/stack"
)

// Version is part of every cache key; bump it when the conversion output changes.
const Version = "aenv-convert-1"

// layerExt names converted layer files in the cache directory.
const layerExt = ".zfile"

// Options tune Convert.
type Options struct {
	// Store holds the image's layer blobs (fetched when missing). Required.
	Store *image.Store
	// Dir caches converted layers, usually <data-dir>/images/overlaybd. Required.
	Dir string
	// SizeMB is the ext4 filesystem size (the template's disk size).
	SizeMB int
	// Progress receives PhaseConvert reports (and download reports); may be nil.
	Progress image.ProgressFunc
	Log      *slog.Logger
	// User, when set, adds a last layer of its own that makes the image a sandbox root
	// exactly as an unpacked template directory is made one (image.PrepareRootFS: mount
	// points, the envd mount point, the account User with its home when the image lacks
	// it). An image that cannot be a sandbox root fails with image.ErrUnusableImage.
	User string
}

// Result is an image's converted stack, bottom first: the empty ext4 base,
// then one layer per OCI layer.
type Result struct {
	SizeMB int              `json:"sizeMB"`
	Layers []stack.LayerRef `json:"layers"`
	Keys   []string         `json:"keys"`
	// Converted counts the layers made by this call (the rest were cached).
	Converted int `json:"-"`
}

// Stack is the layer stack a template made from the image carries in its artifact.
func (r *Result) Stack() *catalog.LayerStack {
	s := &catalog.LayerStack{SizeMB: r.SizeMB, Layers: make([]sandbox.LayerRef, len(r.Layers))}
	for i, l := range r.Layers {
		s.Layers[i] = sandbox.LayerRef(l)
	}
	return s
}

// Manifest is a stack manifest with these layers as lowers and no upper.
func (r *Result) Manifest() *stack.Manifest {
	return &stack.Manifest{VirtualSize: uint64(r.SizeMB) << 20, Lowers: append([]stack.LayerRef(nil), r.Layers...)}
}

// Convert converts img (see the package comment). It must run as root
// (FUSE, loop devices, ext4 mounts). On error nothing is left mounted or
// attached and no partial layer enters the cache.
func Convert(ctx context.Context, img *image.Image, o Options) (*Result, error) {
	if o.Store == nil || o.Dir == "" {
		return nil, errors.New("convert: Options.Store and Options.Dir are required")
	}
	if o.SizeMB < 8 {
		return nil, fmt.Errorf("convert: disk size %d MiB is too small", o.SizeMB)
	}
	if o.Log == nil {
		o.Log = slog.Default()
	}
	progress := o.Progress
	if progress == nil {
		progress = func(image.Progress) {}
	}
	if err := os.MkdirAll(o.Dir, 0o755); err != nil {
		return nil, fmt.Errorf("convert: %w", err)
	}
	// A layer's parent must not change while it is built on (conversions may share the
	// cache directory across processes).
	unlock, err := dirlock.Acquire(ctx, o.Dir)
	if err != nil {
		return nil, fmt.Errorf("convert: %w", err)
	}
	defer unlock()
	if err := o.Store.Fetch(ctx, img, progress); err != nil {
		return nil, err
	}
	res := &Result{SizeMB: o.SizeMB}
	key := fmt.Sprintf("%s-ext4-%dm", Version, o.SizeMB)
	ref, made, err := cached(o.Dir, key, func(out string) error { return baseLayer(ctx, o.Dir, out, o.SizeMB) })
	if err != nil {
		return nil, fmt.Errorf("convert: base ext4: %w", err)
	}
	res.Layers, res.Keys = append(res.Layers, ref), append(res.Keys, key)
	if made {
		res.Converted++
	}
	for n, l := range img.Layers {
		key = chainKey(key, l.DiffID)
		start := time.Now()
		ref, made, err := cached(o.Dir, key, func(out string) error {
			return convertLayer(ctx, o, res.Layers, out, func(mnt string) error {
				_, err := image.ApplyLayer(ctx, o.Store, l, mnt)
				return err
			})
		})
		if err != nil {
			return nil, fmt.Errorf("convert: layer %d (%s): %w", n+1, l.Digest, err)
		}
		res.Layers, res.Keys = append(res.Layers, ref), append(res.Keys, key)
		if made {
			res.Converted++
			o.Log.Debug("convert: layer converted", "layer", n+1, "digest", l.Digest, "elapsed", time.Since(start))
		}
		progress(image.Progress{Phase: image.PhaseConvert, Layer: n + 1, Layers: len(img.Layers), Digest: l.Digest,
			Done: ref.Size, Total: ref.Size, Cached: !made, Final: true})
	}
	if o.User != "" {
		key = chainKey(key, image.PrepareVersion+"\n"+o.User)
		ref, made, err := cached(o.Dir, key, func(out string) error {
			return convertLayer(ctx, o, res.Layers, out, func(mnt string) error {
				_, err := image.PrepareRootFS(mnt, o.User)
				return err
			})
		})
		if err != nil {
			return nil, fmt.Errorf("convert: prepare the sandbox root: %w", err)
		}
		res.Layers, res.Keys = append(res.Layers, ref), append(res.Keys, key)
		if made {
			res.Converted++
		}
	}
	// The data-dir GC (install.GC) spares layers changed within its grace period: the
	// caller has not registered this stack yet, and cached layers may be old.
	now := time.Now()
	for _, l := range res.Layers {
		if err := os.Chtimes(l.Path, now, now); err != nil {
			return nil, fmt.Errorf("convert: %w", err)
		}
	}
	return res, nil
}

// chainKey identifies a layer by everything beneath it, like OCI chain ids.
func chainKey(parent, diffID string) string {
	h := sha256.Sum256([]byte(parent + "\n" + diffID))
	return hex.EncodeToString(h[:])
}

// cached returns the layer cached under key, making it with mk first when
// it is missing. mk writes a complete layer file to its argument.
func cached(dir, key string, mk func(out string) error) (stack.LayerRef, bool, error) {
	final := filepath.Join(dir, key+layerExt)
	made := false
	if _, err := os.Stat(final); err != nil {
		tmp := filepath.Join(dir, "."+key+".tmp")
		os.Remove(tmp)
		if err := mk(tmp); err != nil {
			os.Remove(tmp)
			return stack.LayerRef{}, false, err
		}
		if err := os.Rename(tmp, final); err != nil {
			os.Remove(tmp)
			return stack.LayerRef{}, false, err
		}
		made = true
	}
	ref, err := describe(final)
	return ref, made, err
}

// digestExt names the sidecar that holds a converted layer's sha256 digest.
const digestExt = ".sha256"

// describe reads a layer file's size, UUID and content digest (from its
// sidecar, computed once), so converted layers can be published and
// fetched by digest.
func describe(path string) (stack.LayerRef, error) {
	f, err := os.Open(path)
	if err != nil {
		return stack.LayerRef{}, err
	}
	defer f.Close()
	fi, err := f.Stat()
	if err != nil {
		return stack.LayerRef{}, err
	}
	l, err := blob.Open(f, fi.Size(), path)
	if err != nil {
		return stack.LayerRef{}, fmt.Errorf("open converted layer: %w", err)
	}
	defer l.Close()
	ref := stack.LayerRef{Path: path, Size: fi.Size(), UUID: l.UUID()}
	side := strings.TrimSuffix(path, layerExt) + digestExt
	if b, err := os.ReadFile(side); err == nil && strings.HasPrefix(string(b), "sha256:") {
		ref.Digest = strings.TrimSpace(string(b))
		return ref, nil
	}
	h := sha256.New()
	if _, err := io.Copy(h, io.NewSectionReader(f, 0, fi.Size())); err != nil {
		return stack.LayerRef{}, err
	}
	ref.Digest = "sha256:" + hex.EncodeToString(h.Sum(nil))
	if err := os.WriteFile(side+".tmp", []byte(ref.Digest+"\n"), 0o644); err == nil {
		os.Rename(side+".tmp", side)
	}
	return ref, nil
}

// baseLayer makes an empty ext4 of sizeMB and imports it as a committed,
// ZFile-compressed layer.
func baseLayer(ctx context.Context, dir, out string, sizeMB int) error {
	raw := filepath.Join(dir, ".base-ext4.raw")
	defer os.Remove(raw)
	if err := image.BuildExt4(ctx, "", raw, sizeMB); err != nil {
		return err
	}
	f, err := os.Open(raw)
	if err != nil {
		return err
	}
	defer f.Close()
	return writeZFile(out, func(w *zw) error {
		_, err := lsmt.Import(w, f, lsmt.CommitOptions{})
		return err
	})
}

// convertLayer mounts the filesystem of lowers, changes it with apply (one OCI layer,
// or the sandbox root preparation) and writes the resulting sealed layer, compressed,
// to out.
func convertLayer(ctx context.Context, o Options, lowers []stack.LayerRef, out string, apply func(mnt string) error) (err error) {
	work, err := os.MkdirTemp(o.Dir, ".work-")
	if err != nil {
		return err
	}
	defer os.RemoveAll(work)
	m := &stack.Manifest{Lowers: append([]stack.LayerRef(nil), lowers...),
		Upper: &stack.Upper{Data: filepath.Join(work, "upper.data"), Index: filepath.Join(work, "upper.index")}, Dir: work}
	st, err := stack.Open(ctx, m, stack.Options{})
	if err != nil {
		return err
	}
	defer st.Close()
	if err := applyMounted(ctx, st, work, apply); err != nil {
		return err
	}
	sealed := filepath.Join(work, "sealed")
	ref, err := st.SealAndRestack(ctx, sealed)
	if err != nil {
		return fmt.Errorf("seal: %w", err)
	}
	return compressSealed(sealed, out, ref.UUID)
}

// applyMounted exposes st as a block device, mounts its ext4 and runs apply on it,
// undoing every step before returning.
func applyMounted(ctx context.Context, st *stack.Stack, work string, apply func(mnt string) error) (err error) {
	fm, err := blockdev.MountFile(ctx, filepath.Join(work, "fuse"), st, blockdev.MountOptions{})
	if err != nil {
		return err
	}
	defer func() {
		if cerr := fm.Close(); err == nil {
			err = cerr
		}
	}()
	loop, err := blockdev.AttachLoop(ctx, fm.Path(), false)
	if err != nil {
		return err
	}
	defer func() {
		if derr := loop.Detach(); err == nil {
			err = derr
		}
	}()
	mnt := filepath.Join(work, "mnt")
	if err := os.Mkdir(mnt, 0o755); err != nil {
		return err
	}
	if err := unix.Mount(loop.Path(), mnt, "ext4", 0, ""); err != nil {
		return fmt.Errorf("mount ext4 from %s: %w", loop.Path(), err)
	}
	mounted := true
	defer func() {
		if !mounted {
			return
		}
		if uerr := unix.Unmount(mnt, 0); uerr != nil {
			unix.Unmount(mnt, unix.MNT_DETACH)
			if err == nil {
				err = fmt.Errorf("unmount ext4: %w", uerr)
			}
		}
	}()
	if err := apply(mnt); err != nil {
		return err
	}
	// Unmount now (flushing ext4) so the error, if any, is this layer's.
	mounted = false
	if err := unix.Unmount(mnt, 0); err != nil {
		unix.Unmount(mnt, unix.MNT_DETACH)
		return fmt.Errorf("unmount ext4: %w", err)
	}
	return nil
}
