// Package k8s holds the Kubernetes manifests (kustomize); its test renders them with the
// kustomize library and applies them to a real API server with a server-side dry run.
package k8s

import (
	"context"
	"encoding/json"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"testing"
	"time"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/discovery/cached/memory"
	"k8s.io/client-go/dynamic"
	"k8s.io/client-go/restmapper"
	"sigs.k8s.io/kustomize/api/krusty"
	"sigs.k8s.io/kustomize/kyaml/filesys"

	"github.com/aenv-dev/aenv/internal/cluster/kube/kubetest"
)

// render runs kustomize on dir and returns the objects.
func render(t *testing.T, dir string) []*unstructured.Unstructured {
	t.Helper()
	k := krusty.MakeKustomizer(krusty.MakeDefaultOptions())
	rm, err := k.Run(filesys.MakeFsOnDisk(), dir)
	if err != nil {
		t.Fatalf("kustomize build %s: %v", dir, err)
	}
	var out []*unstructured.Unstructured
	for _, r := range rm.Resources() {
		// Through JSON: unstructured wants JSON's number types (int64), kustomize has Go ints.
		b, err := r.MarshalJSON()
		if err != nil {
			t.Fatal(err)
		}
		u := &unstructured.Unstructured{}
		if err := u.UnmarshalJSON(b); err != nil {
			t.Fatal(err)
		}
		out = append(out, u)
	}
	return out
}

func find(objs []*unstructured.Unstructured, kind, name string) *unstructured.Unstructured {
	for _, o := range objs {
		if o.GetKind() == kind && o.GetName() == name {
			return o
		}
	}
	return nil
}

func TestRender(t *testing.T) {
	base := render(t, "base")
	for _, o := range base {
		if o.GetKind() != "Namespace" && o.GetNamespace() != "aenv-system" {
			t.Errorf("%s %s is not in aenv-system", o.GetKind(), o.GetName())
		}
	}
	sched := find(base, "Deployment", "aenv-scheduler")
	if r, _, _ := unstructured.NestedInt64(sched.Object, "spec", "replicas"); r != 2 {
		t.Errorf("scheduler replicas = %d, want 2", r)
	}
	args, _, _ := unstructured.NestedSlice(sched.Object, "spec", "template", "spec", "containers")
	joined := strings.Join(stringsOf(args[0].(map[string]any)["args"]), " ")
	for _, want := range []string{"--lease=aenv-scheduler", "--nodes-service=aenv-nodes"} {
		if !strings.Contains(joined, want) {
			t.Errorf("scheduler args %q lack %s", joined, want)
		}
	}
	if svc := find(base, "Service", "aenv-nodes"); svc == nil {
		t.Error("no aenv-nodes Service: the scheduler discovers nodes from its EndpointSlices")
	}
	ds := find(base, "DaemonSet", "aenv-node")
	cs, _, _ := unstructured.NestedSlice(ds.Object, "spec", "template", "spec", "containers")
	if p, _, _ := unstructured.NestedBool(cs[0].(map[string]any), "securityContext", "privileged"); !p {
		t.Error("the node DaemonSet is not privileged")
	}
	// Secrets come from Secrets, never from a value in the manifests.
	secretEnv := map[string]string{"AENV_API_KEY": "aenv-api-key", "AENV_CLUSTER_P2P_TOKEN": "aenv-p2p"}
	envs, _, _ := unstructured.NestedSlice(cs[0].(map[string]any), "env")
	for _, e := range envs {
		e := e.(map[string]any)
		want, secret := secretEnv[e["name"].(string)]
		if !secret {
			continue
		}
		delete(secretEnv, e["name"].(string))
		ref, _, _ := unstructured.NestedString(e, "valueFrom", "secretKeyRef", "name")
		if _, literal := e["value"]; literal || ref != want {
			t.Errorf("node env %s = %v, want it from the Secret %s", e["name"], e, want)
		}
	}
	for name := range secretEnv {
		t.Errorf("the node DaemonSet does not set %s", name)
	}

	mon := render(t, "monitoring")
	if len(mon) != len(base)+3 {
		t.Errorf("monitoring renders %d objects, want the base's %d plus two ServiceMonitors and a dashboard", len(mon), len(base))
	}
	// Each ServiceMonitor selects its Service and scrapes a port that Service has.
	for _, name := range []string{"aenv-nodes", "aenv-scheduler"} {
		sm := find(mon, "ServiceMonitor", name)
		if sm == nil {
			t.Fatalf("no ServiceMonitor %s", name)
		}
		sel, _, _ := unstructured.NestedStringMap(sm.Object, "spec", "selector", "matchLabels")
		svc := find(mon, "Service", name)
		for k, v := range sel {
			if svc.GetLabels()[k] != v {
				t.Errorf("the ServiceMonitor %s selects %s=%s, which the %s Service lacks", name, k, v, name)
			}
		}
		eps, _, _ := unstructured.NestedSlice(sm.Object, "spec", "endpoints")
		ports, _, _ := unstructured.NestedSlice(svc.Object, "spec", "ports")
		port := eps[0].(map[string]any)["port"]
		if !slices.ContainsFunc(ports, func(p any) bool { return p.(map[string]any)["name"] == port }) {
			t.Errorf("the ServiceMonitor %s scrapes port %v, which the Service lacks: %v", name, port, ports)
		}
	}
	dash := find(mon, "ConfigMap", "aenv-grafana-dashboard")
	if dash == nil || dash.GetLabels()["grafana_dashboard"] != "1" {
		t.Fatalf("dashboard ConfigMap missing or not labelled for Grafana's sidecar: %v", dash)
	}
	checkDashboard(t, dash)
}

func stringsOf(v any) []string {
	var out []string
	for _, s := range v.([]any) {
		out = append(out, s.(string))
	}
	return out
}

// checkDashboard parses the dashboard and checks that every metric it queries is one a
// node or the scheduler exports (a name that appears in the source as a metric name).
func checkDashboard(t *testing.T, cm *unstructured.Unstructured) {
	data, _, _ := unstructured.NestedStringMap(cm.Object, "data")
	var d struct {
		Panels []struct {
			Title   string
			Targets []struct{ Expr string }
		}
	}
	if err := json.Unmarshal([]byte(data["aenv-dashboard.json"]), &d); err != nil {
		t.Fatalf("dashboard JSON: %v", err)
	}
	known := exportedMetrics(t)
	metric := regexp.MustCompile(`aenv_[a-z_]+`)
	n := 0
	for _, p := range d.Panels {
		for _, tg := range p.Targets {
			for _, m := range metric.FindAllString(tg.Expr, -1) {
				n++
				base := strings.TrimSuffix(strings.TrimSuffix(strings.TrimSuffix(m, "_bucket"), "_sum"), "_count")
				if !known[base] {
					t.Errorf("panel %q queries %s, which neither nodes nor the scheduler export", p.Title, m)
				}
			}
		}
	}
	if n == 0 {
		t.Error("the dashboard queries no aenv metric")
	}
}

func exportedMetrics(t *testing.T) map[string]bool {
	known := map[string]bool{}
	name := regexp.MustCompile(`"(aenv_[a-z_]+)"`)
	err := filepath.WalkDir("../../internal", func(p string, d os.DirEntry, err error) error {
		if err != nil || d.IsDir() || !strings.HasSuffix(p, ".go") || strings.HasSuffix(p, "_test.go") {
			return err
		}
		b, err := os.ReadFile(p)
		if err != nil {
			return err
		}
		for _, m := range name.FindAllSubmatch(b, -1) {
			known[string(m[1])] = true
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	return known
}

// The manifests are applied to a real API server with a server-side dry run (the
// Namespace is created for real, as the namespaced objects need it): schema errors,
// unknown fields and invalid values fail here, not on an operator's cluster. The
// ServiceMonitor needs the Prometheus Operator's CRD, which this API server lacks: it is
// checked by TestRender only.
func TestApplyDryRun(t *testing.T) {
	kc := kubetest.Start(t)
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	dc, err := dynamic.NewForConfig(kc.Config)
	if err != nil {
		t.Fatal(err)
	}
	mapper := restmapper.NewDeferredDiscoveryRESTMapper(memory.NewMemCacheClient(kc.Client.Discovery()))
	apply := func(o *unstructured.Unstructured, dryRun bool) error {
		gvk := o.GroupVersionKind()
		m, err := mapper.RESTMapping(gvk.GroupKind(), gvk.Version)
		if err != nil {
			return err
		}
		body, err := o.MarshalJSON()
		if err != nil {
			return err
		}
		opts := metav1.PatchOptions{FieldManager: "aenv-manifest-test", FieldValidation: "Strict", Force: ptr(true)}
		if dryRun {
			opts.DryRun = []string{metav1.DryRunAll}
		}
		var ri dynamic.ResourceInterface = dc.Resource(m.Resource)
		if o.GetNamespace() != "" {
			ri = dc.Resource(m.Resource).Namespace(o.GetNamespace())
		}
		_, err = ri.Patch(ctx, o.GetName(), types.ApplyPatchType, body, opts)
		return err
	}

	objs := render(t, "monitoring")
	if err := apply(find(objs, "Namespace", "aenv-system"), false); err != nil {
		t.Fatalf("create the namespace: %v", err)
	}
	applied := 0
	for _, o := range objs {
		if o.GetKind() == "ServiceMonitor" {
			continue
		}
		if err := apply(o, true); err != nil {
			t.Errorf("server-side dry run of %s %s: %v", o.GetKind(), o.GetName(), err)
		}
		applied++
	}
	t.Logf("%d objects pass a server-side dry run", applied)

	// The check bites: a misspelt field and an invalid value are refused.
	bad := find(objs, "Deployment", "aenv-scheduler").DeepCopy()
	cs, _, _ := unstructured.NestedSlice(bad.Object, "spec", "template", "spec", "containers")
	cs[0].(map[string]any)["imagePullPolcy"] = "Always"
	_ = unstructured.SetNestedSlice(bad.Object, cs, "spec", "template", "spec", "containers")
	if err := apply(bad, true); err == nil || !strings.Contains(err.Error(), "imagePullPolcy") {
		t.Errorf("a misspelt field passed the dry run: %v", err)
	}
	bad = find(objs, "Service", "aenv-gateway").DeepCopy()
	ports, _, _ := unstructured.NestedSlice(bad.Object, "spec", "ports")
	ports[0].(map[string]any)["port"] = int64(70000)
	_ = unstructured.SetNestedSlice(bad.Object, ports, "spec", "ports")
	if err := apply(bad, true); err == nil {
		t.Error("a Service port of 70000 passed the dry run")
	}
}

func ptr[T any](v T) *T { return &v }
