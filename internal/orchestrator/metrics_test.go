package orchestrator

import (
	"context"
	"fmt"
	"maps"
	"slices"
	"strings"
	"testing"
	"time"

	dto "github.com/prometheus/client_model/go"

	"github.com/aenv-dev/aenv/internal/sandbox"
)

// seriesCounts is every counter's value and every histogram's sample count the
// registry exports, by "name{label=value,...}" (gauges left out: they are states).
func seriesCounts(t *testing.T, h *harness) map[string]float64 {
	t.Helper()
	mfs, err := h.reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	out := map[string]float64{}
	for _, mf := range mfs {
		if !strings.HasPrefix(mf.GetName(), "aenv_") {
			continue
		}
		for _, m := range mf.GetMetric() {
			var ls []string
			for _, l := range m.GetLabel() {
				ls = append(ls, l.GetName()+"="+l.GetValue())
			}
			key := mf.GetName() + "{" + strings.Join(ls, ",") + "}"
			switch mf.GetType() {
			case dto.MetricType_COUNTER:
				out[key] = m.GetCounter().GetValue()
			case dto.MetricType_HISTOGRAM:
				out[key] = float64(m.GetHistogram().GetSampleCount())
			}
		}
	}
	return out
}

func stageKey(op, stage string) string {
	return fmt.Sprintf("aenv_sandbox_stage_duration_seconds{operation=%s,stage=%s,status=ok}", op, stage)
}

// TestLifecycleMetricsExact drives each lifecycle path once — create, pause in memory
// and resume, pause to disk and resume, snapshot, fork, kill, timeout — plus a template
// build's sandbox (created, captured, killed), and checks every counter and histogram
// count the node exports, exactly: nothing missing, nothing extra, builds not counted.
func TestLifecycleMetricsExact(t *testing.T) {
	ctx := context.Background()
	h := newHarness(t, snapModes[0].opts, nil)
	a := h.create(CreateRequest{Timeout: time.Hour})
	if err := h.o.Pause(ctx, a.ID, sandbox.PauseOptions{KeepMemory: true}); err != nil {
		t.Fatal(err)
	}
	if _, _, err := h.o.Connect(ctx, a.ID, ConnectOptions{Timeout: time.Hour}); err != nil {
		t.Fatal(err)
	}
	if err := h.o.Pause(ctx, a.ID, sandbox.PauseOptions{}); err != nil {
		t.Fatal(err)
	}
	if _, _, err := h.o.Connect(ctx, a.ID, ConnectOptions{Timeout: time.Hour}); err != nil {
		t.Fatal(err)
	}
	if _, err := h.o.Snapshot(ctx, a.ID, "snap"); err != nil {
		t.Fatal(err)
	}
	res, err := h.o.Fork(ctx, a.ID, 1, time.Hour)
	if err != nil || len(res) != 1 || res[0].Err != nil {
		t.Fatalf("fork: %+v %v", res, err)
	}
	for _, id := range []string{a.ID, res[0].Sandbox.ID} {
		if err := h.o.Kill(ctx, id); err != nil {
			t.Fatal(err)
		}
	}
	b := h.create(CreateRequest{Timeout: time.Minute})
	h.clock.Advance(2 * time.Minute)
	eventually(t, "timeout kill", func() bool { return h.state(b.ID) == "" })
	h.settle()

	// The template builder's sandbox: its own metrics say how builds go.
	bs := h.create(CreateRequest{Timeout: time.Hour, Metadata: map[string]string{BuildMetadataKey: "b1"}})
	if _, err := h.o.CaptureSandbox(ctx, bs.ID); err != nil {
		t.Fatal(err)
	}
	if err := h.o.Kill(ctx, bs.ID); err != nil {
		t.Fatal(err)
	}

	want := map[string]float64{
		"aenv_sandbox_creates_total{status=ok}":    2,
		"aenv_sandbox_kills_total{reason=api}":     2,
		"aenv_sandbox_kills_total{reason=timeout}": 1,
	}
	add := func(op string, stages ...string) {
		for _, s := range stages {
			want[stageKey(op, s)]++
		}
	}
	add(opCreate, stageResolve, stageLaunch, stageEnvdWait, stageEnvdInit, stagePersist, stageTotal) // a
	add(opCreate, stageResolve, stageLaunch, stageEnvdWait, stageEnvdInit, stagePersist, stageTotal) // b
	add(opPause, stagePause, stagePersist, stageTotal)                                               // in memory
	add(opResume, stageThaw, stagePersist, stageTotal)
	add(opPause, stageCapture, stagePersist, stageStop, stageTotal) // to disk
	add(opResume, stageDecode, stageLaunch, stageEnvdWait, stageEnvdInit, stagePersist, stageTotal)
	add(opSnapshot, stageCapture, stageRegister, stageTotal)
	add(opFork, stageCapture, stageLaunch, stageEnvdWait, stageEnvdInit, stagePersist, stageTotal)
	add(opKill, stageStop, stagePersist, stageTotal) // a
	add(opKill, stageStop, stagePersist, stageTotal) // the fork's child
	add(opKill, stageStop, stagePersist, stageTotal) // b, on timeout

	got := seriesCounts(t, h)
	for _, k := range slices.Sorted(maps.Keys(want)) {
		if got[k] != want[k] {
			t.Errorf("%s = %v, want %v", k, got[k], want[k])
		}
	}
	for _, k := range slices.Sorted(maps.Keys(got)) {
		if _, ok := want[k]; !ok && got[k] != 0 {
			t.Errorf("unexpected %s = %v", k, got[k])
		}
	}
}
