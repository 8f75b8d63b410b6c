package mock

import (
	"context"
	"errors"
	"slices"
	"testing"

	"github.com/aenv-dev/aenv/internal/sandbox"
)

func TestCaptureIsACopyAndRoundTrips(t *testing.T) {
	ctx := context.Background()
	for _, tc := range []struct {
		name      string
		caps      sandbox.Capabilities
		coldBoot  bool
		wantProcs []string
	}{
		{"filesystem only", sandbox.Capabilities{Snapshots: true}, false, nil},
		{"memory", sandbox.Capabilities{Snapshots: true, MemorySnapshots: true}, false, []string{"p"}},
		{"memory, cold boot", sandbox.Capabilities{Snapshots: true, MemorySnapshots: true}, true, nil},
	} {
		t.Run(tc.name, func(t *testing.T) {
			b := New(Options{Capabilities: tc.caps})
			src, err := b.Launch(ctx, sandbox.LaunchPlan{SandboxID: "src"})
			if err != nil {
				t.Fatal(err)
			}
			si := src.(*Instance)
			si.WriteFile("/a", []byte("1"))
			si.StartProcess("p")
			c, err := si.Snapshot(ctx)
			if err != nil {
				t.Fatal(err)
			}
			si.WriteFile("/a", []byte("2"))
			raw, err := c.Encode()
			if err != nil {
				t.Fatal(err)
			}
			dec, err := b.DecodeCaptured(raw)
			if err != nil {
				t.Fatal(err)
			}
			child, err := b.Launch(ctx, sandbox.LaunchPlan{Kind: sandbox.LaunchFromSnapshot, SandboxID: "child",
				Snapshot: dec, ColdBoot: tc.coldBoot})
			if err != nil {
				t.Fatal(err)
			}
			ci := child.(*Instance)
			if v, _ := ci.ReadFile("/a"); string(v) != "1" {
				t.Fatalf("child sees /a=%q", v)
			}
			if got := ci.Processes(); !slices.Equal(got, tc.wantProcs) {
				t.Fatalf("child processes %v, want %v", got, tc.wantProcs)
			}
			ci.WriteFile("/b", nil)
			if _, ok := si.ReadFile("/b"); ok {
				t.Fatal("parent sees the child's write")
			}
		})
	}
}

func TestSnapshotFailuresAndRefusals(t *testing.T) {
	ctx := context.Background()
	off := New(Options{})
	inst, _ := off.Launch(ctx, sandbox.LaunchPlan{SandboxID: "a"})
	if _, err := inst.Snapshot(ctx); err == nil {
		t.Fatal("snapshot succeeded without the Snapshots capability")
	}
	if _, err := off.Launch(ctx, sandbox.LaunchPlan{Kind: sandbox.LaunchFromSnapshot, SandboxID: "b",
		Snapshot: &Captured{SourceID: "a"}}); err == nil {
		t.Fatal("launch from snapshot succeeded without the Snapshots capability")
	}

	b := New(Options{Capabilities: sandbox.Capabilities{Snapshots: true}})
	inst, _ = b.Launch(ctx, sandbox.LaunchPlan{SandboxID: "a"})
	b.Fail(StageSnapshot, sandbox.ErrGone, 1)
	if _, err := inst.Snapshot(ctx); !errors.Is(err, sandbox.ErrGone) || b.Instance("a") != nil {
		t.Fatalf("terminal capture failure: %v, instance left %v", err, b.Instance("a"))
	}
	if _, err := b.Launch(ctx, sandbox.LaunchPlan{Kind: sandbox.LaunchFromSnapshot, SandboxID: "c"}); err == nil {
		t.Fatal("launch from snapshot without a capture succeeded")
	}
	for _, raw := range []string{`not json`, `{}`, `{"files":{}}`} {
		if _, err := b.DecodeCaptured([]byte(raw)); err == nil {
			t.Fatalf("DecodeCaptured(%s) succeeded", raw)
		}
	}
	b.Fail(StageDecodeSnap, errors.New("layer missing"), 1)
	if _, err := b.DecodeCaptured([]byte(`{"sourceID":"a","files":{}}`)); err == nil {
		t.Fatal("injected decode failure ignored")
	}
	if err := b.DiscardSnapshot(ctx, &Captured{SourceID: "x"}); err != nil || !slices.Equal(b.DiscardedSnapshots(), []string{"x"}) {
		t.Fatalf("discard: %v %v", err, b.DiscardedSnapshots())
	}
}
