// Package kube runs the scheduler on Kubernetes: leader election between its replicas
// through a coordination.k8s.io Lease, and node discovery from the EndpointSlices of the
// nodes' Service. It is the only part of aenv that imports client-go; the scheduler
// itself knows nothing of Kubernetes (it exposes Lead/Follow and SetMembers).
package kube

import (
	"fmt"
	"os"
	"strings"

	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"
	"k8s.io/client-go/tools/clientcmd"
)

// Client connects to the API server: from kubeconfig when set (a path), else from the
// pod's service account.
func Client(kubeconfig string) (kubernetes.Interface, error) {
	var cfg *rest.Config
	var err error
	if kubeconfig != "" {
		cfg, err = clientcmd.BuildConfigFromFlags("", kubeconfig)
	} else {
		cfg, err = rest.InClusterConfig()
		if err != nil {
			err = fmt.Errorf("%w (outside a pod, set --kubeconfig)", err)
		}
	}
	if err != nil {
		return nil, fmt.Errorf("kubernetes client: %w", err)
	}
	cfg.UserAgent = "aenv-scheduler"
	return kubernetes.NewForConfig(cfg)
}

// Namespace is the namespace to use when none is given: $POD_NAMESPACE, the pod's own
// (from its service account), or "default".
func Namespace() string {
	if ns := os.Getenv("POD_NAMESPACE"); ns != "" {
		return ns
	}
	if b, err := os.ReadFile("/var/run/secrets/kubernetes.io/serviceaccount/namespace"); err == nil {
		if ns := strings.TrimSpace(string(b)); ns != "" {
			return ns
		}
	}
	return "default"
}
