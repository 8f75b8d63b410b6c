// Package image pulls OCI images (from registries, OCI layouts and docker or
// OCI archives) with go-containerregistry, caches their layer blobs by
// digest, and turns them into aenv templates: an unpacked root filesystem
// plus the image configuration, registered in the catalog.
package image

import (
	"context"
	"errors"
	"fmt"
	"net"
	"net/http"
	"os"
	"runtime"
	"slices"
	"sort"
	"strings"

	"github.com/google/go-containerregistry/pkg/authn"
	"github.com/google/go-containerregistry/pkg/name"
	v1 "github.com/google/go-containerregistry/pkg/v1"
	"github.com/google/go-containerregistry/pkg/v1/remote"
	"github.com/google/go-containerregistry/pkg/v1/remote/transport"
	"github.com/google/go-containerregistry/pkg/v1/tarball"
	"github.com/google/go-containerregistry/pkg/v1/types"
)

// Sentinel errors callers branch on.
var (
	ErrNotFound          = errors.New("image not found")
	ErrPlatform          = errors.New("no image for this platform")
	ErrUnsupportedMedia  = errors.New("unsupported media type")
	ErrDigestMismatch    = errors.New("digest mismatch")
	ErrUnsupportedSource = errors.New("unsupported image source")
	ErrUnauthorized      = errors.New("registry refused the credentials")
)

// Options tune Pull.
type Options struct {
	// Keychain resolves registry credentials. Nil means DockerConfig when set,
	// else authn.DefaultKeychain (~/.docker/config.json, $DOCKER_CONFIG).
	Keychain authn.Keychain
	// DockerConfig is a docker config.json to read credentials from.
	DockerConfig string
	// InsecureRegistries are hosts ("host:port") reached over plain http.
	// Registries on loopback addresses always are, as Docker does.
	InsecureRegistries []string
	// Platform selects from multi-platform indexes; default the host's
	// (linux/GOARCH).
	Platform *v1.Platform
	// Transport is the HTTP transport for registries (default ggcr's).
	Transport http.RoundTripper
	// TempDir holds unpacked oci-archive files until Image.Close (default os.TempDir()).
	TempDir string
}

// HostPlatform is the platform images are picked for by default.
func HostPlatform() v1.Platform {
	return v1.Platform{OS: "linux", Architecture: runtime.GOARCH}
}

// Config is the part of the image configuration a template keeps.
type Config struct {
	Env          []string          `json:"env,omitempty"`
	WorkingDir   string            `json:"workingDir,omitempty"`
	User         string            `json:"user,omitempty"`
	Entrypoint   []string          `json:"entrypoint,omitempty"`
	Cmd          []string          `json:"cmd,omitempty"`
	ExposedPorts []string          `json:"exposedPorts,omitempty"`
	Labels       map[string]string `json:"labels,omitempty"`
	StopSignal   string            `json:"stopSignal,omitempty"`
	OS           string            `json:"os,omitempty"`
	Architecture string            `json:"architecture,omitempty"`
	Variant      string            `json:"variant,omitempty"`
}

// Layer describes one layer of an image, bottom first.
type Layer struct {
	Digest    string `json:"digest"`    // compressed blob digest (what is fetched and cached)
	DiffID    string `json:"diffID"`    // uncompressed tar digest (from the config)
	Size      int64  `json:"size"`      // compressed size
	MediaType string `json:"mediaType"` // as in the manifest
}

// Image is a resolved image: manifest and config read, layers not fetched.
type Image struct {
	Source   Source  `json:"source"`
	Digest   string  `json:"digest"` // manifest digest
	Config   Config  `json:"config"`
	Layers   []Layer `json:"layers"`
	img      v1.Image
	cleanups []func()
}

// Close releases what Pull set aside (an unpacked oci-archive).
func (i *Image) Close() error {
	for _, f := range slices.Backward(i.cleanups) {
		f()
	}
	i.cleanups = nil
	return nil
}

// Pull resolves ref (see ParseReference) to one image for the platform and
// reads its manifest and config. Layer blobs are fetched later (Store.Fetch),
// through the same connection settings; ctx bounds all of it.
func Pull(ctx context.Context, ref string, o Options) (*Image, error) {
	src, err := ParseReference(ref)
	if err != nil {
		return nil, fmt.Errorf("pull %s: %w", ref, err)
	}
	plat := HostPlatform()
	if o.Platform != nil {
		plat = *o.Platform
	}
	img := &Image{Source: src}
	var vimg v1.Image
	switch src.Transport {
	case Registry:
		vimg, err = pullRemote(ctx, src.Ref, plat, o)
	case OCILayout:
		vimg, err = fromLayout(src.Path, src.Ref, plat)
	case OCIArchive:
		var dir string
		dir, err = unpackArchive(ctx, src.Path, o.TempDir)
		if err == nil {
			img.cleanups = append(img.cleanups, func() { os.RemoveAll(dir) })
			vimg, err = fromLayout(dir, src.Ref, plat)
		}
	case DockerArchive:
		vimg, err = fromDockerArchive(src.Path, src.Ref)
	default:
		err = fmt.Errorf("%w: %s", ErrUnsupportedSource, src.Transport)
	}
	if err == nil {
		err = img.describe(vimg, plat)
	}
	if err != nil {
		img.Close()
		return nil, fmt.Errorf("pull %s: %w", src, err)
	}
	return img, nil
}

func pullRemote(ctx context.Context, ref string, plat v1.Platform, o Options) (v1.Image, error) {
	r, err := name.ParseReference(ref)
	if err != nil {
		return nil, fmt.Errorf("%w: %w", ErrBadReference, err)
	}
	if insecure(r.Context().RegistryStr(), o.InsecureRegistries) {
		if r, err = name.ParseReference(ref, name.Insecure); err != nil {
			return nil, fmt.Errorf("%w: %w", ErrBadReference, err)
		}
	}
	kc := o.Keychain
	if kc == nil && o.DockerConfig != "" {
		kc = fileKeychain{path: o.DockerConfig}
	}
	if kc == nil {
		kc = authn.DefaultKeychain
	}
	opts := []remote.Option{remote.WithContext(ctx), remote.WithAuthFromKeychain(kc),
		remote.WithPlatform(plat), remote.WithUserAgent("aenv")}
	if o.Transport != nil {
		opts = append(opts, remote.WithTransport(o.Transport))
	}
	img, err := remote.Image(r, opts...)
	if err != nil {
		return nil, classify(err)
	}
	return img, nil
}

// classify maps registry errors onto the sentinels callers branch on.
func classify(err error) error {
	var te *transport.Error
	if errors.As(err, &te) {
		switch te.StatusCode {
		case http.StatusNotFound:
			return fmt.Errorf("%w: %w", ErrNotFound, err)
		case http.StatusUnauthorized, http.StatusForbidden:
			return fmt.Errorf("%w: %w", ErrUnauthorized, err)
		}
	}
	if strings.Contains(err.Error(), "no child with platform") {
		return fmt.Errorf("%w: %w", ErrPlatform, err)
	}
	return err
}

// insecure reports whether registry host is reached over plain http: listed
// as insecure, or on a loopback address (Docker's rule).
func insecure(host string, list []string) bool {
	if slices.Contains(list, host) {
		return true
	}
	h := host
	if hh, _, err := net.SplitHostPort(host); err == nil {
		h = hh
	}
	h = strings.Trim(h, "[]")
	if h == "localhost" || strings.HasSuffix(h, ".localhost") {
		return true
	}
	ip := net.ParseIP(h)
	return ip != nil && ip.IsLoopback()
}

func fromDockerArchive(path, ref string) (v1.Image, error) {
	if _, err := os.Stat(path); err != nil {
		return nil, fmt.Errorf("%w: %w", ErrNotFound, err)
	}
	var tag *name.Tag
	if ref != "" {
		t, err := name.NewTag(ref)
		if err != nil {
			return nil, fmt.Errorf("%w: %w", ErrBadReference, err)
		}
		tag = &t
	}
	img, err := tarball.ImageFromPath(path, tag)
	if err != nil {
		return nil, fmt.Errorf("docker archive %s: %w", path, err)
	}
	return img, nil
}

// describe fills the Image from the manifest and config, refusing layer
// media types it cannot unpack and images for another platform.
func (i *Image) describe(img v1.Image, plat v1.Platform) error {
	d, err := img.Digest()
	if err != nil {
		return fmt.Errorf("manifest digest: %w", err)
	}
	m, err := img.Manifest()
	if err != nil {
		return fmt.Errorf("manifest: %w", err)
	}
	cf, err := img.ConfigFile()
	if err != nil {
		return fmt.Errorf("config: %w", err)
	}
	if cf.OS != "" && cf.Architecture != "" {
		got := v1.Platform{OS: cf.OS, Architecture: cf.Architecture, Variant: cf.Variant}
		if !got.Satisfies(plat) {
			return fmt.Errorf("%w: the image is for %s, wanted %s", ErrPlatform, got.String(), plat.String())
		}
	}
	if len(m.Layers) != len(cf.RootFS.DiffIDs) {
		return fmt.Errorf("manifest has %d layers, config %d diff ids", len(m.Layers), len(cf.RootFS.DiffIDs))
	}
	i.img = img
	i.Digest = d.String()
	for n, l := range m.Layers {
		if !supportedLayer(l.MediaType) {
			return fmt.Errorf("%w: layer %d is %s", ErrUnsupportedMedia, n, l.MediaType)
		}
		i.Layers = append(i.Layers, Layer{Digest: l.Digest.String(), DiffID: cf.RootFS.DiffIDs[n].String(),
			Size: l.Size, MediaType: string(l.MediaType)})
	}
	c := cf.Config
	i.Config = Config{Env: c.Env, WorkingDir: c.WorkingDir, User: c.User, Entrypoint: c.Entrypoint,
		Cmd: c.Cmd, Labels: c.Labels, StopSignal: c.StopSignal,
		OS: cf.OS, Architecture: cf.Architecture, Variant: cf.Variant}
	for p := range c.ExposedPorts {
		i.Config.ExposedPorts = append(i.Config.ExposedPorts, p)
	}
	sort.Strings(i.Config.ExposedPorts)
	return nil
}

func supportedLayer(mt types.MediaType) bool {
	switch mt {
	case types.OCILayer, types.OCIUncompressedLayer, types.OCILayerZStd, types.DockerLayer, types.DockerUncompressedLayer:
		return true
	}
	return false
}

// Platform is an OS/architecture pair (go-containerregistry's type).
type Platform = v1.Platform
