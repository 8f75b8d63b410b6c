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
	if err := os.Mkdir(dir, 0o555); err != nil && !errors.Is(err, os.ErrExist) {
		return "", fmt.Errorf("oci: empty dir: %w", err)
	}
	if err := os.Chmod(dir, 0o555); err != nil {
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

// hostSysDirs are the masked paths under /sys that are directories on this host (the
// sandbox's /sys is the host's or a sysfs of the same kernel). runc masks a directory
// with a read-only tmpfs of its own: a superblock per directory per sandbox, and every
// superblock is a memcg-aware shrinker that grows every memory cgroup on the host (see
// docs/operations.md, "Per memory cgroup"). A read-only bind of one shared empty
// directory hides the same and adds no superblock. Under /proc runc refuses binds (only
// lxcfs's files), so those stay masked by runc.
var hostSysDirs = sync.OnceValue(func() []string {
	var dirs []string
	for _, p := range maskedPaths {
		if !strings.HasPrefix(p, "/sys/") {
			continue
		}
		if fi, err := os.Lstat(p); err == nil && fi.IsDir() {
			dirs = append(dirs, p)
		}
	}
	return dirs
})

// maskBinds splits masked into the paths runc masks and the read-only binds of empty
// (a host directory, "" for none) over sysDirs, which come out of masked.
func maskBinds(masked, sysDirs []string, empty string) ([]string, []specs.Mount) {
	if empty == "" || len(sysDirs) == 0 {
		return masked, nil
	}
	var rest []string
	var binds []specs.Mount
	for _, p := range masked {
		if !slices.Contains(sysDirs, p) {
			rest = append(rest, p)
			continue
		}
		binds = append(binds, specs.Mount{Destination: p, Type: "none", Source: empty,
			Options: []string{"bind", "ro", "nosuid", "nodev", "noexec"}})
	}
	return rest, binds
}
