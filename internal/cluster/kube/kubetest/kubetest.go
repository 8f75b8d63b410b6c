// Package kubetest starts a real Kubernetes API server (etcd and kube-apiserver, driven by
// controller-runtime's envtest) for tests. The binaries come from $KUBEBUILDER_ASSETS or
// the directory scripts/k8s-test-bins.sh builds them into; without them tests skip,
// saying how to get them.
package kubetest

import (
	"bytes"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"
	"sigs.k8s.io/controller-runtime/pkg/envtest"
)

// Cluster is a running API server.
type Cluster struct {
	Config *rest.Config
	// Kubeconfig is a file for processes the test starts (an admin user).
	Kubeconfig string
	Client     kubernetes.Interface
}

// AssetsDir is where the etcd and kube-apiserver binaries are expected.
func AssetsDir(t testing.TB) string {
	if d := os.Getenv("KUBEBUILDER_ASSETS"); d != "" {
		return d
	}
	root := repoRoot(t)
	out, err := exec.Command(filepath.Join(root, "scripts", "k8s-test-bins.sh"), "dir").Output()
	if err != nil {
		t.Fatalf("scripts/k8s-test-bins.sh dir: %v", err)
	}
	return strings.TrimSpace(string(out))
}

func repoRoot(t testing.TB) string {
	dir, err := os.Getwd()
	if err != nil {
		t.Fatal(err)
	}
	for {
		if b, err := os.ReadFile(filepath.Join(dir, "go.mod")); err == nil && bytes.Contains(b, []byte("module github.com/aenv-dev/aenv\n")) {
			return dir
		}
		parent := filepath.Dir(dir)
		if parent == dir {
			t.Fatal("cannot find the aenv repository root above the working directory")
		}
		dir = parent
	}
}

// Start runs an API server until the test ends, or skips the test when the binaries are
// missing.
func Start(t testing.TB) *Cluster {
	t.Helper()
	dir := AssetsDir(t)
	if missing := Missing(dir); missing != "" {
		t.Skip(missing)
	}
	env, err := Up(dir)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if err := env.Stop(); err != nil {
			t.Errorf("stop the test API server: %v", err)
		}
	})
	cs, err := kubernetes.NewForConfig(env.Config)
	if err != nil {
		t.Fatal(err)
	}
	kc := filepath.Join(t.TempDir(), "kubeconfig")
	if err := os.WriteFile(kc, env.KubeConfig, 0o600); err != nil {
		t.Fatal(err)
	}
	return &Cluster{Config: env.Config, Kubeconfig: kc, Client: cs}
}

// Missing says what is missing to run an API server from the binaries in dir, or "".
func Missing(dir string) string {
	for _, bin := range []string{"etcd", "kube-apiserver"} {
		if fi, err := os.Stat(filepath.Join(dir, bin)); err != nil || fi.Mode()&0o111 == 0 {
			return fmt.Sprintf("no %s in %s: build the Kubernetes test binaries with `make k8s-test-bins` (or set KUBEBUILDER_ASSETS)", bin, dir)
		}
	}
	return ""
}

// Env is a running API server; Stop ends it.
type Env struct {
	*envtest.Environment
	// Config reaches it as an admin.
	Config *rest.Config
}

// Up starts etcd and kube-apiserver from the binaries in dir. Processes other than Go
// tests (the SDK end-to-end tests, through cmd kubeapi-test) use it directly.
func Up(dir string) (*Env, error) {
	env := &envtest.Environment{BinaryAssetsDirectory: dir, ControlPlaneStartTimeout: 2 * time.Minute,
		ControlPlaneStopTimeout: 30 * time.Second}
	api := env.ControlPlane.GetAPIServer()
	// On loopback there is no node the default reconciler could publish for the
	// kubernetes Service; the tests do not need one.
	api.Configure().Set("endpoint-reconciler-type", "none")
	cfg, err := env.Start()
	if err != nil {
		return nil, fmt.Errorf("start the test API server (%s): %w", dir, err)
	}
	return &Env{Environment: env, Config: cfg}, nil
}
