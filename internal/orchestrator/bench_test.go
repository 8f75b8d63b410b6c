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
