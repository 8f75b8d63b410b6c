package build

import (
	"context"
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"
)

func tagList(t *testing.T, s *Service, name string) string {
	t.Helper()
	tags, err := s.Tags(name)
	if err != nil {
		t.Fatal(err)
	}
	var out []string
	for _, tg := range tags {
		out = append(out, tg.Tag+"="+tg.BuildID)
	}
	return strings.Join(out, " ")
}

// TestBuildTagsAndMetrics builds one template three times (two ready, one failed) and
// checks the tags each build gets, tag changes, and the build metrics.
func TestBuildTagsAndMetrics(t *testing.T) {
	reg := prometheus.NewRegistry()
	n := newRealNode(t, Config{Registerer: reg})
	ctx := context.Background()
	build := func(nameTag string, tags []string, spec Spec) Record {
		t.Helper()
		rec, err := n.svc.Request(ctx, RequestOptions{Name: nameTag, Tags: tags})
		if err != nil {
			t.Fatal(err)
		}
		if err := n.svc.Start(ctx, rec.TemplateID, rec.ID, spec); err != nil {
			t.Fatal(err)
		}
		return n.wait(t, rec)
	}
	ok := Spec{FromTemplate: "base", Steps: []Step{{Type: StepRun, Args: []string{"true"}}}}
	b1 := build("tagged:v1", []string{"prod"}, ok)
	b2 := build("tagged", nil, ok)
	bad := build("tagged:broken", nil, Spec{FromTemplate: "base", Steps: []Step{{Type: StepRun, Args: []string{"exit 4"}}}})
	if b1.Status != StatusReady || b2.Status != StatusReady || bad.Status != StatusError {
		t.Fatalf("builds: %s %s %s\n%s", b1.Status, b2.Status, bad.Status, n.logText(b2.ID))
	}
	if got, want := tagList(t, n.svc, "tagged"), "default="+b2.ID+" prod="+b1.ID+" v1="+b1.ID; got != want {
		t.Errorf("tags = %s, want %s", got, want)
	}
	id, tags, err := n.svc.AssignTags("tagged:v1", []string{"stable"})
	if err != nil || id != b1.ID || len(tags) != 1 {
		t.Fatalf("AssignTags = %s %v %v", id, tags, err)
	}
	if err := n.svc.RemoveTags("tagged", []string{"prod", "nope"}); !errors.Is(err, ErrNotFound) {
		t.Errorf("removing an unknown tag: %v", err)
	}
	if err := n.svc.RemoveTags("tagged", []string{"prod"}); err != nil {
		t.Fatal(err)
	}
	if _, _, err := n.svc.AssignTags("tagged:broken", []string{"x"}); !errors.Is(err, ErrNotFound) {
		t.Errorf("tagging through the failed build's tag: %v", err)
	}
	if got, want := tagList(t, n.svc, b1.TemplateID), "default="+b2.ID+" stable="+b1.ID+" v1="+b1.ID; got != want {
		t.Errorf("tags = %s, want %s", got, want)
	}
	// v1 names the first build, which the second replaced: only the newest build runs.
	for q, want := range map[string]error{"tagged:default": nil, "tagged": nil, "tagged:v1": ErrNotFound,
		"tagged:prod": ErrNotFound, "tagged:broken": ErrNotFound, "nope:v1": ErrNotFound} {
		if tp, err := n.svc.ResolveTag(q); !errors.Is(err, want) || (want == nil && tp.ID != b1.TemplateID) {
			t.Errorf("ResolveTag(%s) = %s, %v; want %v", q, tp.ID, err, want)
		}
	}
	// Tags survive a restart of the builder.
	n.svc.Close()
	svc2, err := New(n.svc.cfg, n.orch, n.cat.Templates())
	if err != nil {
		t.Fatal(err)
	}
	if got := tagList(t, svc2, "tagged"); !strings.Contains(got, "stable="+b1.ID) {
		t.Errorf("tags after restart: %s", got)
	}
	if _, err := svc2.Delete(ctx, "tagged"); err != nil {
		t.Fatal(err)
	}
	if got := svc2.tags.list(b1.TemplateID); len(got) != 0 {
		t.Errorf("tags of a deleted template: %v", got)
	}
	svc2.Close()

	m := n.svc.met
	if r, e := testutil.ToFloat64(m.builds.WithLabelValues("ready")), testutil.ToFloat64(m.builds.WithLabelValues("error")); r != 2 || e != 1 {
		t.Errorf("builds: %v ready, %v error", r, e)
	}
	if f := testutil.ToFloat64(m.failures.WithLabelValues("step")); f != 1 {
		t.Errorf("failures at a step: %v", f)
	}
	if r := testutil.ToFloat64(m.running); r != 0 {
		t.Errorf("running: %v", r)
	}
	// Every phase of the ready builds was timed, and the failed one up to its steps.
	mfs, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	counts := map[string]uint64{}
	for _, mf := range mfs {
		if mf.GetName() != "aenv_template_build_phase_duration_seconds" {
			continue
		}
		for _, mm := range mf.GetMetric() {
			counts[mm.GetLabel()[0].GetValue()] = mm.GetHistogram().GetSampleCount()
		}
	}
	for phase, want := range map[string]uint64{PhaseQueue: 3, PhaseBase: 3, PhaseSandbox: 3, PhaseSteps: 3, PhaseReady: 2, PhaseCapture: 2, PhaseRegister: 2} {
		if counts[phase] != want {
			t.Errorf("phase %s timed %d times, want %d (all: %v)", phase, counts[phase], want, counts)
		}
	}
}

// wait polls a started build until it has finished.
func (n *realNode) wait(t *testing.T, rec Record) Record {
	t.Helper()
	deadline := time.Now().Add(3 * time.Minute)
	for time.Now().Before(deadline) {
		r, err := n.svc.Get(rec.TemplateID, rec.ID)
		if err != nil {
			t.Fatal(err)
		}
		if r.Status.Finished() {
			return r
		}
		time.Sleep(100 * time.Millisecond)
	}
	t.Fatal("build did not finish within 3 minutes")
	return Record{}
}
