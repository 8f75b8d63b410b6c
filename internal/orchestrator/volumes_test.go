package orchestrator

import (
	"bytes"
	"context"
	"errors"
	"os"
	"testing"
	"time"

	"github.com/aenv-dev/aenv/internal/sandbox"
	"github.com/aenv-dev/aenv/internal/sandbox/mock"
	"github.com/aenv-dev/aenv/internal/secret"
	"github.com/aenv-dev/aenv/internal/volume"
)

// mounterBackend is the mock with volume support (as the oci backend has).
type mounterBackend struct{ *mock.Backend }

func (mounterBackend) MountsVolumes() bool { return true }

func volumeHarness(t *testing.T, mounts bool) (*harness, *volume.Store, *secret.Store) {
	t.Helper()
	vs, err := volume.Open(t.TempDir(), volume.Options{})
	if err != nil {
		t.Fatal(err)
	}
	ss, err := secret.Open(t.TempDir())
	if err != nil {
		t.Fatal(err)
	}
	h := newHarness(t, snapModes[0].opts, nil)
	if mounts {
		h.wrap = func(b *mock.Backend) sandbox.Backend { return mounterBackend{b} }
	}
	h.opts = []Option{WithVolumes(vs), WithSecrets(ss)}
	h.restart()
	return h, vs, ss
}

func lastPlan(h *harness) sandbox.LaunchPlan {
	l := h.b.Launches()
	return l[len(l)-1]
}

func TestVolumeMountsFollowTheSandbox(t *testing.T) {
	ctx := context.Background()
	h, vs, _ := volumeHarness(t, true)
	v, err := vs.Create("alice", "data")
	if err != nil {
		t.Fatal(err)
	}
	mount := []VolumeMount{{Name: "data", Path: "/mnt/data", VolumeID: v.ID}}
	for _, bad := range []struct {
		owner  string
		mounts []VolumeMount
	}{
		{"bob", mount}, // another owner's volume
		{"alice", []VolumeMount{{Name: "data", Path: "/proc/x", VolumeID: v.ID}}},
		{"alice", []VolumeMount{{Name: "x", Path: "/mnt/x", VolumeID: "vol_00000000000000000000"}}},
		{"alice", append(mount, VolumeMount{Name: "data", Path: "/mnt/data", VolumeID: v.ID})},
	} {
		n := len(h.b.Launches())
		if _, err := h.o.Create(ctx, CreateRequest{TemplateID: "base", Owner: bad.owner, VolumeMounts: bad.mounts}); !errors.Is(err, ErrInvalid) {
			t.Fatalf("create %+v: %v, want ErrInvalid", bad, err)
		}
		if len(h.b.Launches()) != n {
			t.Fatalf("a refused create launched")
		}
	}

	src := h.create(CreateRequest{Owner: "alice", VolumeMounts: mount, Timeout: time.Hour})
	want := []sandbox.Mount{{Source: vs.Dir(v.ID), Destination: "/mnt/data"}}
	if got := lastPlan(h).Mounts; len(got) != 1 || got[0] != want[0] {
		t.Fatalf("launch mounts %+v, want %+v", got, want)
	}
	if got := h.stored(src.ID).VolumeMounts; len(got) != 1 || got[0] != mount[0] {
		t.Fatalf("stored mounts %+v", got)
	}

	// A snapshot records the mounts; sandboxes created from it and fork children mount them.
	snap, err := h.o.Snapshot(ctx, src.ID, "with-volume")
	if err != nil {
		t.Fatal(err)
	}
	tpl, err := h.cat.Templates().Resolve(snap.SnapshotID)
	if err != nil || len(tpl.VolumeMounts) != 1 || tpl.VolumeMounts[0] != mount[0] {
		t.Fatalf("snapshot record mounts %+v %v", tpl.VolumeMounts, err)
	}
	child := h.create(CreateRequest{TemplateID: snap.SnapshotID, Owner: "alice"})
	if got := lastPlan(h).Mounts; len(got) != 1 || got[0] != want[0] || len(child.VolumeMounts) != 1 {
		t.Fatalf("child of snapshot: plan %+v record %+v", got, child.VolumeMounts)
	}
	// Another owner cannot reach alice's volume through her snapshot.
	if _, err := h.o.Create(ctx, CreateRequest{TemplateID: snap.SnapshotID, Owner: "bob"}); !errors.Is(err, ErrInvalid) {
		t.Fatalf("bob from alice's snapshot: %v", err)
	}
	res, err := h.o.Fork(ctx, src.ID, 1, time.Minute)
	if err != nil || res[0].Err != nil {
		t.Fatalf("fork: %v %+v", err, res)
	}
	if got := lastPlan(h).Mounts; len(got) != 1 || got[0] != want[0] || len(res[0].Sandbox.VolumeMounts) != 1 {
		t.Fatalf("fork child mounts %+v", got)
	}

	// After a restart, a resume still mounts the volume.
	if err := h.o.Pause(ctx, src.ID, sandbox.PauseOptions{}); err != nil {
		t.Fatal(err)
	}
	h.restart()
	if _, _, err := h.o.Connect(ctx, src.ID, ConnectOptions{Timeout: time.Minute}); err != nil {
		t.Fatal(err)
	}
	if got := h.stored(src.ID).Launch.Mounts; len(got) != 1 || got[0] != want[0] {
		t.Fatalf("mounts after restart %+v", got)
	}
}

func TestVolumesRefusedWithoutBackendSupport(t *testing.T) {
	h, vs, _ := volumeHarness(t, false)
	v, err := vs.Create("alice", "data")
	if err != nil {
		t.Fatal(err)
	}
	_, err = h.o.Create(context.Background(), CreateRequest{TemplateID: "base", Owner: "alice",
		VolumeMounts: []VolumeMount{{Name: "data", Path: "/mnt/data", VolumeID: v.ID}}})
	if !errors.Is(err, ErrUnsupported) {
		t.Fatalf("create with volumes on a backend without them: %v", err)
	}
	if n := len(h.b.Launches()); n != 0 {
		t.Fatalf("%d launches", n)
	}
}

func TestSecretsExpandedOnlyForEnvd(t *testing.T) {
	h, _, ss := volumeHarness(t, true)
	const value = "very-secret-value-123"
	if _, err := ss.Create("alice", "tok", value, nil); err != nil {
		t.Fatal(err)
	}
	sb := h.create(CreateRequest{Owner: "alice", EnvVars: map[string]string{"TOKEN": "x-${e2b.secrets.tok}"}})
	inits := h.b.Instance(sb.ID).Envd().Inits()
	if got := inits[len(inits)-1].EnvVars["TOKEN"]; got != "x-"+value {
		t.Fatalf("envd got TOKEN=%q", got)
	}
	if got := h.stored(sb.ID).EnvVars["TOKEN"]; got != "x-${e2b.secrets.tok}" {
		t.Fatalf("record holds %q", got)
	}
	if raw, err := os.ReadFile(h.dbPath); err != nil || bytes.Contains(raw, []byte(value)) {
		t.Fatalf("catalog holds the value (%v)", err)
	}
	// Another owner's sandbox does not resolve alice's secret.
	if _, err := h.o.Create(context.Background(), CreateRequest{TemplateID: "base", Owner: "bob",
		EnvVars: map[string]string{"TOKEN": "${e2b.secrets.tok}"}}); !errors.Is(err, ErrInvalid) {
		t.Fatalf("bob's create: %v", err)
	}
}

func TestSecretsInRuleHeadersExpandedAtEgress(t *testing.T) {
	h, _, ss := volumeHarness(t, true)
	if _, err := ss.Create("alice", "tok", "hdr-value", nil); err != nil {
		t.Fatal(err)
	}
	rules := map[string][]sandbox.Transform{"api.example.com": {{Headers: map[string]string{"Authorization": "Bearer ${e2b.secrets.tok}"}}}}
	sb := h.create(CreateRequest{Owner: "alice", Egress: Egress{Rules: rules}})
	pol, _ := h.b.Instance(sb.ID).Egress()
	if got := pol.Rules["api.example.com"][0].Headers["Authorization"]; got != "Bearer hdr-value" {
		t.Fatalf("proxy got %q", got)
	}
	if got := h.stored(sb.ID).Egress.Rules["api.example.com"][0].Headers["Authorization"]; got != "Bearer ${e2b.secrets.tok}" {
		t.Fatalf("record holds %q", got)
	}
}
