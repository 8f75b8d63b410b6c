// Package integration runs the real `aenv serve` as a subprocess, as root, with real runc
// sandboxes, and checks what only a whole node can show: a node that crashes (kill -9) and
// restarts adopts the sandboxes that survived and leaks nothing; a graceful shutdown leaves
// exactly what its configuration says; sandboxes created through the API are isolated from
// each other and from the node. Tests skip, saying why, when not root or without runc.
//
// The binaries are built from this checkout once per run (or taken from $AENV_IT_BIN_DIR);
// the base template comes from bin/base-rootfs when `make base` built it, else it is built
// as `make base` does, into the machine's cache (/var/cache/aenv, once per machine).
package integration

import (
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"sync"
	"testing"
	"time"

	"github.com/aenv-dev/aenv/internal/template/base"
)

// binaries are what every test runs.
type binaries struct {
	aenv, envd, baseRootFS string
	// skip, when set, is why this host cannot run the tests.
	skip string
}

// buildOnce builds the binaries the first time a test asks; later tests get the same result.
// The build directory is removed by TestMain.
var buildOnce = sync.OnceValues(func() (binaries, error) { return build() })

// buildDir holds the binaries of this run; set once in TestMain before any test runs.
var buildDir string

func TestMain(m *testing.M) {
	dir, err := os.MkdirTemp("", "aenv-it-bin-")
	if err != nil {
		fmt.Fprintln(os.Stderr, "integration:", err)
		os.Exit(1)
	}
	// Sandbox roots (user namespaces) must traverse to the rootfs copies made from here.
	_ = os.Chmod(dir, 0o755)
	buildDir = dir
	code := m.Run()
	os.RemoveAll(dir)
	// Each node's cgroups are removed by its cleanup; the shared parent is the suite's.
	parents, _ := filepath.Glob("/sys/fs/cgroup/*/aenv-it")
	for _, p := range parents {
		os.Remove(p)
	}
	os.Exit(code)
}

// needNode returns the binaries, or skips the test when the host cannot run a node.
func needNode(t testing.TB) binaries {
	t.Helper()
	b, err := buildOnce()
	if err != nil {
		t.Fatalf("build: %v", err)
	}
	if b.skip != "" {
		t.Skip(b.skip)
	}
	return b
}

func build() (binaries, error) {
	if os.Geteuid() != 0 {
		return binaries{skip: "needs root: aenv serve runs OCI containers, network namespaces and overlay mounts"}, nil
	}
	if _, err := exec.LookPath("runc"); err != nil {
		return binaries{skip: "needs runc on PATH (apt-get install runc)"}, nil
	}
	root, err := repoRoot()
	if err != nil {
		return binaries{}, err
	}
	ctx, cancel := context.WithTimeout(context.Background(), 15*time.Minute)
	defer cancel()
	b := binaries{aenv: filepath.Join(buildDir, "aenv"), envd: filepath.Join(buildDir, "envd")}
	targets := []struct{ out, pkg string }{{b.aenv, "./cmd/aenv"}, {b.envd, "./cmd/envd"}}
	if dir := os.Getenv("AENV_IT_BIN_DIR"); dir != "" {
		// Prebuilt binaries (e.g. bin/ after `make binaries`) instead of building this checkout.
		b.aenv, b.envd, targets = filepath.Join(dir, "aenv"), filepath.Join(dir, "envd"), nil
	}
	for _, c := range targets {
		cmd := exec.CommandContext(ctx, "go", "build", "-trimpath", "-o", c.out, c.pkg)
		cmd.Dir = root
		cmd.Env = append(os.Environ(), "CGO_ENABLED=0")
		if out, err := cmd.CombinedOutput(); err != nil {
			return binaries{}, fmt.Errorf("go build %s: %w\n%s", c.pkg, err, out)
		}
	}
	b.baseRootFS = filepath.Join(root, "bin", "base-rootfs")
	if !base.DebianBuilt(b.baseRootFS) {
		b.baseRootFS = "/var/cache/aenv/base-debian"
		cmd := exec.CommandContext(ctx, b.aenv, "template", "build-base", "--out", b.baseRootFS, "--cache", "/var/cache/aenv/debootstrap")
		if out, err := cmd.CombinedOutput(); err != nil {
			return binaries{}, fmt.Errorf("build the base template (or run `make base`): %w\n%s", err, out)
		}
	}
	return b, nil
}

// repoRoot is the directory holding go.mod, found upwards from the test's directory.
func repoRoot() (string, error) {
	dir, err := os.Getwd()
	if err != nil {
		return "", err
	}
	for {
		if _, err := os.Stat(filepath.Join(dir, "go.mod")); err == nil {
			return dir, nil
		}
		parent := filepath.Dir(dir)
		if parent == dir {
			return "", errors.New("no go.mod above the test directory")
		}
		dir = parent
	}
}
