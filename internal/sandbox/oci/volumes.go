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

// volumeMounts prepares plan mounts for inst and returns them as spec mounts. In a user
// namespace each volume is first bind-mounted under the bundle with an id-mapping, so that
// a file owned by uid N on the host is owned by uid N in every sandbox, whatever its uid
// range: sandboxes sharing a volume agree on owners, as on one filesystem. The staging
// mounts live under the bundle, so teardown and Reconcile unmount them with the rest.
func volumeMounts(l layout, mounts []sandbox.Mount, userns int) ([]specs.Mount, error) {
	out := make([]specs.Mount, 0, len(mounts))
	for n, m := range mounts {
		if fi, err := os.Stat(m.Source); err != nil || !fi.IsDir() {
			return nil, fmt.Errorf("oci: volume directory %s: not a directory (%v)", m.Source, err)
		}
		src := m.Source
		if userns >= 0 {
			src = filepath.Join(l.dir, "volumes", strconv.Itoa(n))
			if err := os.MkdirAll(src, 0o700); err != nil {
				return nil, fmt.Errorf("oci: %w", err)
			}
			if err := idmappedBindAttr(m.Source, src, userns, unix.MOUNT_ATTR_IDMAP); err != nil {
				return nil, err
			}
		}
		out = append(out, specs.Mount{Destination: m.Destination, Type: "none", Source: src,
			Options: []string{"rbind", "nosuid", "nodev"}})
	}
	return out, nil
}
