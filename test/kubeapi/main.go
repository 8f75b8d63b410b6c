// Command kubeapi runs a test Kubernetes API server (etcd and kube-apiserver, as the Go
// tests' kubetest does) for test processes that are not Go tests: the SDK end-to-end
// tests start two `aenv scheduler` replicas electing a leader through a Lease on it.
// It writes an admin kubeconfig to -write-kubeconfig once the server answers, and stops the
// server when its stdin closes (its parent is gone) or on SIGTERM/SIGINT.
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"os/signal"
	"path/filepath"
	"syscall"

	"github.com/aenv-dev/aenv/internal/cluster/kube/kubetest"
)

func main() {
	// A flag set of its own: controller-runtime registers -kubeconfig on the global one.
	fs := flag.NewFlagSet("kubeapi", flag.ExitOnError)
	assets := fs.String("assets", os.Getenv("KUBEBUILDER_ASSETS"), "directory with the etcd and kube-apiserver binaries (scripts/k8s-test-bins.sh dir)")
	kubeconfig := fs.String("write-kubeconfig", "", "write the admin kubeconfig here once the API server answers")
	_ = fs.Parse(os.Args[1:])
	if err := run(*assets, *kubeconfig); err != nil {
		fmt.Fprintln(os.Stderr, "kubeapi:", err)
		os.Exit(1)
	}
}

func run(assets, kubeconfig string) error {
	if assets == "" || kubeconfig == "" {
		return errors.New("-assets and -write-kubeconfig are required")
	}
	if missing := kubetest.Missing(assets); missing != "" {
		return errors.New(missing)
	}
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGTERM, syscall.SIGINT)
	defer stop()
	env, err := kubetest.Up(assets)
	if err != nil {
		return err
	}
	defer env.Stop()
	// Written whole under a temporary name, then renamed: a reader polling for the
	// file never sees half of it.
	tmp := filepath.Join(filepath.Dir(kubeconfig), "."+filepath.Base(kubeconfig)+".tmp")
	if err := os.WriteFile(tmp, env.KubeConfig, 0o600); err != nil {
		return err
	}
	if err := os.Rename(tmp, kubeconfig); err != nil {
		return err
	}
	parentGone := make(chan struct{})
	go func() {
		_, _ = io.Copy(io.Discard, os.Stdin)
		close(parentGone)
	}()
	select {
	case <-ctx.Done():
	case <-parentGone:
	}
	return nil
}
