package oci

import (
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"strings"
	"time"

	"golang.org/x/sys/unix"
)

const probeID = "aenv-probe"

// probe picks the runtime by running a tiny container shaped like a real sandbox (same
// namespaces, cgroup limits, seccomp, envd bind mount, overlay root; with and without a
// user namespace) and keeping the first combination that works. crun comes first: it
// starts no Go program per sandbox (runc and runc's init do), which halves the CPU the
// sandboxes' own cgroup burns per create and fork child (docs/operations.md, "crun").
// Hosts differ: runsc often cannot start at all.
func (b *Backend) probe(ctx context.Context) (runtimeCLI, bool, error) {
	names := []string{"crun", "runc"}
	switch b.cfg.Runtime {
	case "auto":
		names = heldFirst(b.cfg.DataDir, names)
	case "runc", "crun", "runsc":
		names = []string{b.cfg.Runtime}
	default:
		names = []string{b.cfg.Runtime} // a path
	}
	usernsModes := []bool{true, false}
	switch b.cfg.UserNamespace {
	case UserNSOn:
		usernsModes = []bool{true}
	case UserNSOff:
		usernsModes = []bool{false}
	}
	key, kerr := b.probeKey(names)
	if kerr == nil {
		if rt, userns, ok := b.cachedProbe(key); ok {
			b.log.Info("oci: runtime probe answered from cache", "runtime", rt.name, "userns", userns)
			return rt, userns, nil
		}
	}
	var errs []error
	for _, n := range names {
		bin, err := lookRuntime(n)
		if err != nil {
			errs = append(errs, err)
			continue
		}
		name := strings.TrimSuffix(filepath.Base(n), filepath.Ext(n))
		rt := runtimeCLI{name: name, bin: bin, root: filepath.Join(b.cfg.DataDir, name)}
		for _, userns := range usernsModes {
			err := b.tryRuntime(ctx, rt, userns)
			if err == nil {
				if !userns && b.cfg.UserNamespace == UserNSAuto {
					b.log.Warn("oci: sandboxes run WITHOUT user namespaces (sandbox root is host root, confined by seccomp, capabilities and namespaces)",
						"hint", untraversable(b.cfg.DataDir))
				}
				if kerr == nil {
					if err := b.saveProbe(key, rt, userns); err != nil {
						b.log.Warn("oci: cannot cache the runtime probe", "err", err)
					}
				}
				return rt, userns, nil
			}
			b.log.Info("oci: runtime probe failed", "runtime", name, "userns", userns, "err", err)
			errs = append(errs, fmt.Errorf("%s (userns=%v): %w", name, userns, err))
		}
	}
	return runtimeCLI{}, false, fmt.Errorf("%w: %w", ErrNoRuntime, errors.Join(errs...))
}

// heldFirst puts first the runtimes whose state root under dataDir holds a container:
// the sandboxes a restarted node adopts are the ones the last node's runtime runs, and
// only that runtime lists, pauses and deletes them. A node upgraded to prefer crun keeps
// runc until runc's containers are gone.
func heldFirst(dataDir string, names []string) []string {
	var held, rest []string
	for _, n := range names {
		if holdsContainer(filepath.Join(dataDir, n)) {
			held = append(held, n)
		} else {
			rest = append(rest, n)
		}
	}
	return append(held, rest...)
}

// holdsContainer says whether a runtime's state root holds a container's directory.
func holdsContainer(root string) bool {
	ents, err := os.ReadDir(root)
	if err != nil {
		return false
	}
	for _, e := range ents {
		if e.IsDir() && e.Name() != probeID {
			return true
		}
	}
	return false
}

func (b *Backend) tryRuntime(ctx context.Context, rt runtimeCLI, userns bool) (err error) {
	ctx, cancel := context.WithTimeout(ctx, 20*time.Second)
	defer cancel()
	dir := filepath.Join(b.cfg.DataDir, "probe")
	lower := filepath.Join(dir, "lower")
	l := layout{dir: filepath.Join(dir, "bundle")}
	cleanup := func() error {
		return errors.Join(rt.remove(context.WithoutCancel(ctx), probeID), unmountAll(dir), os.RemoveAll(dir))
	}
	if err := cleanup(); err != nil {
		return err
	}
	defer func() {
		if cerr := cleanup(); cerr != nil && err == nil {
			err = cerr
		}
	}()
	if err := os.MkdirAll(filepath.Join(lower, "bin"), 0o755); err != nil {
		return err
	}
	if err := os.MkdirAll(l.dir, 0o711); err != nil {
		return err
	}
	if err := os.Chmod(dir, 0o711); err != nil {
		return err
	}
	if err := copyExecutable(b.cfg.Busybox, filepath.Join(lower, "bin", "busybox")); err != nil {
		return fmt.Errorf("probe needs a static busybox (Debian busybox-static): %w", err)
	}
	var m *idMap
	fd := -1
	if userns {
		m = &idMap{HostID: b.cfg.UIDBase, Size: idRangeSize}
		if fd, err = usernsFD(*m); err != nil {
			return err
		}
		defer closeFD(fd)
	}
	if err := mountRootfs(l, lower, m, fd); err != nil {
		return err
	}
	cgroups := b.viewCgroups(rt)
	spec := buildSpec(specParams{
		rootfs: l.rootfs(), hostname: probeID, envdPath: b.cfg.EnvdPath, cgroupBinds: cgroups,
		args:        []string{"/bin/busybox", "sh", "-c", "touch /probe && test -e " + envdMount + " && echo probe-ok"},
		env:         []string{"PATH=/bin"},
		cgroupsPath: b.cgroupsPath(probeID), cpuCount: 1, memoryMB: 64, pidsLimit: 64, idmap: m, memsw: b.memsw,
	})
	if err := writeJSON(filepath.Join(l.dir, "config.json"), spec); err != nil {
		return err
	}
	out, err := rt.runForeground(ctx, probeID, l.dir, cgroups)
	if err != nil {
		return err
	}
	if !strings.Contains(string(out), "probe-ok") {
		return fmt.Errorf("probe container printed %q", out)
	}
	return nil
}

// untraversable names the first ancestor of dir that others cannot traverse: a sandbox
// root mapped to an unprivileged host uid must reach its rootfs below dir.
func untraversable(dir string) string {
	for d := dir; ; d = filepath.Dir(d) {
		if fi, err := os.Stat(d); err == nil && fi.Mode().Perm()&0o001 == 0 {
			return fmt.Sprintf("%s is not traversable by others (chmod o+x %s enables user namespaces)", d, d)
		}
		if d == "/" || d == "." {
			return "the runtime or kernel refused user namespaces; see the probe errors above"
		}
	}
}

func copyExecutable(src, dst string) error {
	in, err := os.Open(src)
	if err != nil {
		return err
	}
	defer in.Close()
	out, err := os.OpenFile(dst, os.O_CREATE|os.O_WRONLY|os.O_TRUNC, 0o755)
	if err != nil {
		return err
	}
	if _, err := io.Copy(out, in); err != nil {
		out.Close()
		return err
	}
	return out.Close()
}

func closeFD(fd int) {
	if fd >= 0 {
		_ = unix.Close(fd)
	}
}
