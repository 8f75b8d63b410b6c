package orchestrator

import (
	"context"
	"testing"

	"github.com/aenv-dev/aenv/internal/sandbox"
)

// BenchmarkCreateKill measures the orchestrator's own cost of a create and a kill on
// the mock backend: template lookup, envd health and init over loopback HTTP, and
// the catalog writes (each an fsync).
func BenchmarkCreateKill(b *testing.B) {
	h := newHarness(b, backendModes[0].opts, nil)
	ctx := context.Background()
	b.ReportAllocs()
	for b.Loop() {
		sb, err := h.o.Create(ctx, CreateRequest{TemplateID: "base", Secure: true})
		if err != nil {
			b.Fatal(err)
		}
		if err := h.o.Kill(ctx, sb.ID); err != nil {
			b.Fatal(err)
		}
	}
}

// BenchmarkPauseResume measures a freezer-style pause and resume round trip.
func BenchmarkPauseResume(b *testing.B) {
	h := newHarness(b, backendModes[0].opts, nil)
	ctx := context.Background()
	sb, err := h.o.Create(ctx, CreateRequest{TemplateID: "base"})
	if err != nil {
		b.Fatal(err)
	}
	for b.Loop() {
		if err := h.o.Pause(ctx, sb.ID, sandbox.PauseOptions{}); err != nil {
			b.Fatal(err)
		}
		if _, _, err := h.o.Connect(ctx, sb.ID, ConnectOptions{}); err != nil {
			b.Fatal(err)
		}
	}
}

// BenchmarkSnapshot measures the orchestrator's cost of a snapshot (capture on the
// mock, catalog registration with its fsync) and of deleting it again.
func BenchmarkSnapshot(b *testing.B) {
	h := newHarness(b, snapModes[0].opts, nil)
	ctx := context.Background()
	sb, err := h.o.Create(ctx, CreateRequest{TemplateID: "base"})
	if err != nil {
		b.Fatal(err)
	}
	b.ReportAllocs()
	for b.Loop() {
		info, err := h.o.Snapshot(ctx, sb.ID, "")
		if err != nil {
			b.Fatal(err)
		}
		if err := h.o.DeleteTemplate(ctx, info.SnapshotID); err != nil {
			b.Fatal(err)
		}
	}
}

// BenchmarkFork16 measures a fork into 16 children (each launched, envd-initialised
// and persisted) and killing them.
func BenchmarkFork16(b *testing.B) {
	h := newHarness(b, snapModes[0].opts, nil)
	ctx := context.Background()
	sb, err := h.o.Create(ctx, CreateRequest{TemplateID: "base", Secure: true})
	if err != nil {
		b.Fatal(err)
	}
	for b.Loop() {
		res, err := h.o.Fork(ctx, sb.ID, 16, 0)
		if err != nil {
			b.Fatal(err)
		}
		for _, r := range res {
			if r.Err != nil {
				b.Fatal(r.Err)
			}
			if err := h.o.Kill(ctx, r.Sandbox.ID); err != nil {
				b.Fatal(err)
			}
		}
	}
}

// BenchmarkPauseToDiskResume measures a pause to disk and the relaunch from it.
func BenchmarkPauseToDiskResume(b *testing.B) {
	h := newHarness(b, snapModes[0].opts, nil)
	ctx := context.Background()
	sb, err := h.o.Create(ctx, CreateRequest{TemplateID: "base"})
	if err != nil {
		b.Fatal(err)
	}
	for b.Loop() {
		if err := h.o.Pause(ctx, sb.ID, sandbox.PauseOptions{KeepMemory: false}); err != nil {
			b.Fatal(err)
		}
		if _, _, err := h.o.Connect(ctx, sb.ID, ConnectOptions{}); err != nil {
			b.Fatal(err)
		}
	}
}
