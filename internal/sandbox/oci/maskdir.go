package oci

import (
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"

	specs "github.com/opencontainers/runtime-spec/specs-go"
)

// emptyDirName is the directory below the data directory that masks directories in
// every sandbox (see maskBinds): empty, owned by the host's root, read-only to all.
const emptyDirName = "empty"

// makeEmptyDir creates (or checks) dataDir's empty directory and returns its path; an
// error means it is not usable (not empty, not a directory) and sandboxes mask with a
// tmpfs each as before.
func makeEmptyDir(dataDir string) (string, error) {
	dir := filepath.Join(dataDir, emptyDirName)
	if err := readOnlyDir(dir); err != nil {
		return "", fmt.Errorf("oci: empty dir: %w", err)
	}
	f, err := os.Open(dir)
	if err != nil {
		return "", fmt.Errorf("oci: empty dir: %w", err)
	}
	defer f.Close()
	if _, err := f.Readdirnames(1); !errors.Is(err, io.EOF) {
		return "", fmt.Errorf("oci: empty dir %s is not an empty directory (%v)", dir, err)
	}
	return dir, nil
}

// readOnlyDir creates dir, or keeps it when it exists, read-only to all (mode 555).
func readOnlyDir(dir string) error {
	if err := os.Mkdir(dir, 0o555); err != nil && !errors.Is(err, os.ErrExist) {
		return err
	}
	return os.Chmod(dir, 0o555)
}

// hostMaskedDirs are the masked paths that are directories on this host (the sandbox's
// /proc and /sys show the same kernel). A runtime masks a directory with a read-only
// tmpfs of its own: a superblock per directory per sandbox, and every superblock is a
// memcg-aware shrinker that grows every memory cgroup on the host (see
// docs/operations.md, "Per memory cgroup"). A read-only bind of one shared empty
// directory hides the same and adds no superblock.
var hostMaskedDirs = sync.OnceValue(func() []string {
	var dirs []string
	for _, p := range maskedPaths {
		if fi, err := os.Lstat(p); err == nil && fi.IsDir() {
			dirs = append(dirs, p)
		}
	}
	return dirs
})

// bindMaskedDirs are the host's masked directories the runtime rt lets a bind mask:
// those under /sys, and under /proc too where rt takes binds there (crun; runc refuses
// them but for lxcfs's files).
func bindMaskedDirs(rt runtimeCLI) []string {
	var dirs []string
	for _, d := range hostMaskedDirs() {
		if strings.HasPrefix(d, "/sys/") || rt.bindsUnderProc() {
			dirs = append(dirs, d)
		}
	}
	return dirs
}

// cgroupViewDirName is the directory below the data directory whose read-only bind is
// the /sys/fs/cgroup of sandboxes that see only the hierarchies they are in
// (specParams.cgroupBinds): an empty directory per hierarchy, their binds' mount points.
// It takes the place of a tmpfs (a superblock) per sandbox.
const cgroupViewDirName = "cgroupview"

// makeCgroupViewDir creates (or completes) dataDir's cgroup view for the hierarchies
// (host mount points) hs and returns its path. It never removes a directory: one may be
// a mount point in a sandbox that outlived the node, and removing it would unmount the
// sandbox's hierarchy there.
func makeCgroupViewDir(dataDir string, hs []string) (string, error) {
	dir := filepath.Join(dataDir, cgroupViewDirName)
	if err := readOnlyDir(dir); err != nil {
		return "", fmt.Errorf("oci: cgroup view: %w", err)
	}
	for _, h := range hs {
		if err := readOnlyDir(filepath.Join(dir, filepath.Base(h))); err != nil {
			return "", fmt.Errorf("oci: cgroup view: %w", err)
		}
	}
	return dir, nil
}

// maskBinds splits masked into the paths the runtime masks and the read-only binds of
// empty (a host directory, "" for none) over dirs, which come out of masked.
func maskBinds(masked, dirs []string, empty string) ([]string, []specs.Mount) {
	if empty == "" || len(dirs) == 0 {
		return masked, nil
	}
	var rest []string
	var binds []specs.Mount
	for _, p := range masked {
		if !slices.Contains(dirs, p) {
			rest = append(rest, p)
			continue
		}
		binds = append(binds, specs.Mount{Destination: p, Type: "none", Source: empty,
			Options: []string{"bind", "ro", "nosuid", "nodev", "noexec"}})
	}
	return rest, binds
}
