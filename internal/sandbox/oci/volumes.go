package oci

import (
	"fmt"
	"os"
	"path/filepath"
	"strconv"

	specs "github.com/opencontainers/runtime-spec/specs-go"
	"golang.org/x/sys/unix"

	"github.com/aenv-dev/aenv/internal/sandbox"
)

var _ sandbox.VolumeMounter = (*Backend)(nil)

// MountsVolumes implements sandbox.VolumeMounter: volumes are bind mounts of host
// directories, id-mapped for a user-namespaced sandbox.
func (b *Backend) MountsVolumes() bool { return true }

// volumeMounts prepares plan mounts for inst and returns them as spec mounts. Each volume
// is first bind-mounted under the bundle, and the runtime binds that: the runtime runs in
// a launch namespace copied from a template that may predate the volume's filesystem (a
// host whose mounts are private propagates nothing into it), and the launch namespace
// gets each mount below the sandbox's directory cloned in fresh (see launchNS.enter).
// In a user namespace the staging bind is id-mapped, so that a file owned by uid N on the
// host is owned by uid N in every sandbox, whatever its uid range: sandboxes sharing a
// volume agree on owners, as on one filesystem. The staging mounts live under the
// bundle, so teardown and Reconcile unmount them with the rest.
func volumeMounts(l layout, mounts []sandbox.Mount, userns int) ([]specs.Mount, error) {
	out := make([]specs.Mount, 0, len(mounts))
	for n, m := range mounts {
		if fi, err := os.Stat(m.Source); err != nil || !fi.IsDir() {
			return nil, fmt.Errorf("oci: volume directory %s: not a directory (%v)", m.Source, err)
		}
		src := filepath.Join(l.dir, "volumes", strconv.Itoa(n))
		if err := os.MkdirAll(src, 0o700); err != nil {
			return nil, fmt.Errorf("oci: %w", err)
		}
		var attr uint64
		if userns >= 0 {
			attr = unix.MOUNT_ATTR_IDMAP
		}
		if err := idmappedBindAttr(m.Source, src, userns, attr); err != nil {
			return nil, err
		}
		out = append(out, specs.Mount{Destination: m.Destination, Type: "none", Source: src,
			Options: []string{"rbind", "nosuid", "nodev"}})
	}
	return out, nil
}
