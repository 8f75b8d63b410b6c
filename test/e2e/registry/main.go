// Command registry serves an in-memory OCI registry on a loopback port for the SDK
// end-to-end tests, seeded with one image made from the host's static busybox and bash
// (the base template's root filesystem), so template builds can use fromImage without
// any network; with -debian-root also the test/debian images (debian:bookworm, ...). It
// prints "READY <host:port> <image>" once the images are pushed and then serves until
// killed.
package main

import (
	"bytes"
	"context"
	"flag"
	"fmt"
	"io"
	"log"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"runtime"

	"github.com/google/go-containerregistry/pkg/name"
	"github.com/google/go-containerregistry/pkg/registry"
	v1 "github.com/google/go-containerregistry/pkg/v1"
	"github.com/google/go-containerregistry/pkg/v1/empty"
	"github.com/google/go-containerregistry/pkg/v1/mutate"
	"github.com/google/go-containerregistry/pkg/v1/remote"
	"github.com/google/go-containerregistry/pkg/v1/tarball"
	"github.com/google/go-containerregistry/pkg/v1/types"

	"github.com/aenv-dev/aenv/internal/template/base"
	"github.com/aenv-dev/aenv/test/debian"
)

func main() {
	rootfs := flag.String("rootfs", "", "root filesystem to publish (default: build the base rootfs in a temp dir)")
	repo := flag.String("image", "aenv-e2e/tools:1", "repository:tag to publish")
	debianRoot := flag.String("debian-root", "", "also publish the test/debian images made from this Debian root (scripts/debian-root.sh)")
	flag.Parse()
	log.SetFlags(0)
	var tmp string
	if *rootfs == "" {
		dir, err := os.MkdirTemp("", "aenv-e2e-registry-")
		if err != nil {
			log.Fatal(err)
		}
		tmp = dir
		*rootfs = filepath.Join(dir, "rootfs")
		if err := base.Build(context.Background(), base.Options{Out: *rootfs}); err != nil {
			os.RemoveAll(tmp)
			log.Fatal(err)
		}
	}
	layer, err := debian.TarDir(*rootfs)
	// The layer is in memory now; the tests stop this helper with SIGKILL, so a deferred
	// removal would never run and every e2e run would leave its rootfs in /tmp.
	if tmp != "" {
		os.RemoveAll(tmp)
	}
	if err != nil {
		log.Fatal(err)
	}
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		log.Fatal(err)
	}
	go func() { log.Fatal(http.Serve(ln, registry.New(registry.Logger(log.New(io.Discard, "", 0))))) }()

	l, err := tarball.LayerFromOpener(func() (io.ReadCloser, error) { return io.NopCloser(bytes.NewReader(layer)), nil },
		tarball.WithMediaType(types.OCILayer))
	if err != nil {
		log.Fatal(err)
	}
	img, err := mutate.AppendLayers(empty.Image, l)
	if err != nil {
		log.Fatal(err)
	}
	cf, err := img.ConfigFile()
	if err != nil {
		log.Fatal(err)
	}
	cf = cf.DeepCopy()
	cf.OS, cf.Architecture = "linux", runtime.GOARCH
	cf.Config = v1.Config{Env: []string{"PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin", "IMAGE_ENV=from-image"}}
	if img, err = mutate.ConfigFile(mutate.MediaType(img, types.OCIManifestSchema1), cf); err != nil {
		log.Fatal(err)
	}
	ref, err := name.ParseReference(ln.Addr().String()+"/"+*repo, name.Insecure)
	if err != nil {
		log.Fatal(err)
	}
	if err := remote.Write(ref, img); err != nil {
		log.Fatal(err)
	}
	if *debianRoot != "" {
		imgs, err := debian.Images(*debianRoot)
		if err != nil {
			log.Fatal(err)
		}
		if _, err := debian.Push(ln.Addr().String(), imgs); err != nil {
			log.Fatal(err)
		}
	}
	fmt.Printf("READY %s %s\n", ln.Addr(), ref.String())
	select {}
}
