package orchestrator

import (
	"context"
	"encoding/json"
	"errors"
	"reflect"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/aenv-dev/aenv/internal/catalog"
	"github.com/aenv-dev/aenv/internal/sandbox"
	"github.com/aenv-dev/aenv/internal/sandbox/mock"
)

// snapModes are backends that can snapshot: a container-like one (filesystem captures,
// pause in place) and a VM-like one (memory captures, pause stops the instance).
var snapModes = []struct {
	name string
	opts mock.Options
}{
	{"container", mock.Options{Capabilities: sandbox.Capabilities{PauseKeepsProcesses: true, Snapshots: true}}},
	{"vm", mock.Options{StopOnPause: true, Capabilities: sandbox.Capabilities{MemorySnapshots: true,
		PauseKeepsProcesses: true, PauseReleasesMemory: true, LiveFork: true, Snapshots: true}}},
}

func (h *harness) inst(id string) *mock.Instance {
	h.t.Helper()
	i := h.b.Instance(id)
	if i == nil {
		h.t.Fatalf("sandbox %s has no live instance", id)
	}
	return i
}

func (h *harness) file(id, path string) string {
	h.t.Helper()
	v, ok := h.inst(id).ReadFile(path)
	if !ok {
		return "<missing>"
	}
	return string(v)
}

func (h *harness) snapshotTemplates() []catalog.Template {
	h.t.Helper()
	ts, err := h.cat.Templates().List(catalog.KindSnapshot)
	if err != nil {
		h.t.Fatal(err)
	}
	return ts
}

func TestSnapshotKeepsSourceRunningAndCreatesFromIt(t *testing.T) {
	ctx := context.Background()
	for _, mode := range snapModes {
		t.Run(mode.name, func(t *testing.T) {
			h := newHarness(t, mode.opts, nil)
			src := h.create(CreateRequest{Secure: true, Timeout: time.Minute, EnvVars: map[string]string{"OWN": "1"}})
			parent := h.inst(src.ID)
			parent.WriteFile("/a", []byte("1"))
			parent.StartProcess("server")

			info, err := h.o.Snapshot(ctx, src.ID, "golden")
			if err != nil {
				t.Fatal(err)
			}
			if info.SnapshotID == "" || info.SnapshotID == src.ID || !slices.Equal(info.Names, []string{"golden"}) ||
				info.SourceSandboxID != src.ID || info.ParentID != "" {
				t.Fatalf("snapshot info %+v", info)
			}
			after, _ := h.o.Get(ctx, src.ID)
			if after.State != StateRunning || h.b.Instance(src.ID) != parent || parent.Frozen() ||
				after.EnvdAccessToken != src.EnvdAccessToken || !after.EndAt.Equal(src.EndAt) {
				t.Fatalf("source after snapshot: %+v (instance kept: %v)", after, h.b.Instance(src.ID) == parent)
			}
			tpl, err := h.cat.Templates().Resolve("golden")
			if err != nil {
				t.Fatal(err)
			}
			if tpl.ID != info.SnapshotID || tpl.Kind != catalog.KindSnapshot || tpl.SourceSandboxID != src.ID ||
				tpl.Backend != "mock" || tpl.Resources != src.Resources || tpl.EnvVars["OWN"] != "1" ||
				tpl.EnvVars["FROM_TEMPLATE"] != "1" || len(tpl.Artifact) == 0 {
				t.Fatalf("snapshot template %+v", tpl)
			}
			parent.WriteFile("/a", []byte("2")) // later writes of the parent stay its own

			for _, ref := range []string{info.SnapshotID, "golden"} {
				child := h.create(CreateRequest{TemplateID: ref, Secure: true})
				if child.TemplateID != info.SnapshotID || child.Launch.ParentSnapshot != info.SnapshotID {
					t.Fatalf("child from %q: %+v", ref, child)
				}
				ci := h.inst(child.ID)
				if in := ci.Envd().Inits(); len(in) != 1 || in[0].HeaderToken != src.EnvdAccessToken || in[0].AccessToken != child.EnvdAccessToken {
					t.Fatalf("child from %q: envd init %+v, want the source's token in the header", ref, in)
				}
				if tpl.EnvdAccessToken != src.EnvdAccessToken {
					t.Fatalf("snapshot template keeps envd token %q, want the source's", tpl.EnvdAccessToken)
				}
				if got := h.file(child.ID, "/a"); got != "1" {
					t.Fatalf("child from %q sees /a=%q, want the snapshot's 1", ref, got)
				}
				if ci.Plan().Kind != sandbox.LaunchFromSnapshot || ci.Plan().Snapshot == nil || !ci.Plan().SnapshotTemplate {
					t.Fatalf("child plan %+v", ci.Plan())
				}
				wantProcs := []string(nil)
				if mode.opts.Capabilities.MemorySnapshots {
					wantProcs = []string{"server"}
				}
				if got := ci.Processes(); !slices.Equal(got, wantProcs) {
					t.Fatalf("child processes %v, want %v", got, wantProcs)
				}
				ci.WriteFile("/child", []byte(ref))
				if _, ok := parent.ReadFile("/child"); ok {
					t.Fatal("the parent sees a child's write")
				}
				// A snapshot of a child records its lineage.
				grand, err := h.o.Snapshot(ctx, child.ID, "")
				if err != nil || grand.ParentID != info.SnapshotID || len(grand.Names) != 0 {
					t.Fatalf("snapshot of child: %+v, %v", grand, err)
				}
			}
			if n := histCount(t, h, opSnapshot, stageTotal, "ok"); n != 3 {
				t.Fatalf("snapshot total observations = %d, want 3", n)
			}
			if n := histCount(t, h, opSnapshot, stageCapture, "ok"); n != 3 {
				t.Fatalf("snapshot capture observations = %d, want 3", n)
			}
		})
	}
}

func TestSnapshotRefusals(t *testing.T) {
	ctx := context.Background()
	noSnap := mock.Options{Capabilities: sandbox.Capabilities{PauseKeepsProcesses: true}}
	for _, tc := range []struct {
		name    string
		opts    mock.Options
		prepare func(h *harness, id string) (target, snapName string)
		want    error
		gone    bool // the sandbox is removed (terminal capture failure)
	}{
		{"unknown sandbox", snapModes[0].opts, func(h *harness, id string) (string, string) { return "nope", "" }, ErrNotFound, false},
		{"bad name", snapModes[0].opts, func(h *harness, id string) (string, string) { return id, "a/b" }, ErrInvalid, false},
		{"name of a template", snapModes[0].opts, func(h *harness, id string) (string, string) { return id, "default" }, ErrConflict, false},
		{"paused in place", snapModes[0].opts, func(h *harness, id string) (string, string) {
			if err := h.o.Pause(ctx, id, sandbox.PauseOptions{KeepMemory: true}); err != nil {
				h.t.Fatal(err)
			}
			return id, ""
		}, ErrConflict, false},
		{"paused to disk", snapModes[1].opts, func(h *harness, id string) (string, string) {
			if err := h.o.Pause(ctx, id, sandbox.PauseOptions{}); err != nil {
				h.t.Fatal(err)
			}
			return id, ""
		}, ErrConflict, false},
		{"backend without snapshots", noSnap, func(h *harness, id string) (string, string) { return id, "x" }, ErrUnsupported, false},
		{"backend cannot capture this sandbox", snapModes[0].opts, func(h *harness, id string) (string, string) {
			h.b.Fail(mock.StageSnapshot, sandbox.ErrUnsupported, 1)
			return id, "x"
		}, ErrUnsupported, false},
		{"capture fails", snapModes[0].opts, func(h *harness, id string) (string, string) {
			h.b.Fail(mock.StageSnapshot, errors.New("disk full"), 1)
			return id, "x"
		}, nil, false},
		{"capture kills the sandbox", snapModes[0].opts, func(h *harness, id string) (string, string) {
			h.b.Fail(mock.StageSnapshot, sandbox.ErrGone, 1)
			return id, "x"
		}, sandbox.ErrGone, true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			h := newHarness(t, tc.opts, nil)
			sb := h.create(CreateRequest{Timeout: time.Minute})
			target, name := tc.prepare(h, sb.ID)
			before := h.state(sb.ID)
			_, err := h.o.Snapshot(ctx, target, name)
			if err == nil || (tc.want != nil && !errors.Is(err, tc.want)) {
				t.Fatalf("Snapshot = %v, want %v", err, tc.want)
			}
			if n := len(h.snapshotTemplates()); n != 0 {
				t.Fatalf("%d snapshot templates registered after a refused snapshot", n)
			}
			if tc.gone {
				if h.state(sb.ID) != "" || h.stored(sb.ID) != nil || slices.Contains(h.b.Live(), sb.ID) {
					t.Fatal("sandbox whose capture reported it gone is still there")
				}
				return
			}
			if got := h.state(sb.ID); got != before {
				t.Fatalf("state %q after refused snapshot, want %q", got, before)
			}
		})
	}
}

func TestListSnapshotsFiltersAndPages(t *testing.T) {
	ctx := context.Background()
	h := newHarness(t, snapModes[0].opts, nil)
	a := h.create(CreateRequest{Timeout: time.Hour})
	b := h.create(CreateRequest{Timeout: time.Hour})
	var ids []string // oldest first
	for i, src := range []string{a.ID, b.ID, a.ID, a.ID, b.ID} {
		name := ""
		if i == 2 {
			name = "third"
		}
		info, err := h.o.Snapshot(ctx, src, name)
		if err != nil {
			t.Fatal(err)
		}
		ids = append(ids, info.SnapshotID)
		h.clock.Advance(time.Second)
	}
	newestFirst := slices.Clone(ids)
	slices.Reverse(newestFirst)

	var got []string
	tok := ""
	pages := 0
	for {
		items, next, err := h.o.ListSnapshots(ctx, SnapshotFilter{Limit: 2, NextToken: tok})
		if err != nil {
			t.Fatal(err)
		}
		pages++
		for _, it := range items {
			got = append(got, it.SnapshotID)
		}
		if next == "" {
			break
		}
		tok = next
	}
	if pages != 3 || !slices.Equal(got, newestFirst) {
		t.Fatalf("paged %d pages: %v, want %v", pages, got, newestFirst)
	}
	items, next, err := h.o.ListSnapshots(ctx, SnapshotFilter{SandboxID: b.ID})
	if err != nil || next != "" || len(items) != 2 || items[0].SnapshotID != ids[4] || items[1].SnapshotID != ids[1] {
		t.Fatalf("by sandbox: %+v %q %v", items, next, err)
	}
	items, _, err = h.o.ListSnapshots(ctx, SnapshotFilter{Name: "third"})
	if err != nil || len(items) != 1 || items[0].SnapshotID != ids[2] || !slices.Equal(items[0].Names, []string{"third"}) {
		t.Fatalf("by name: %+v %v", items, err)
	}
	for _, f := range []SnapshotFilter{{Limit: -1}, {Limit: 101}, {NextToken: "!!"}} {
		if _, _, err := h.o.ListSnapshots(ctx, f); !errors.Is(err, ErrInvalid) {
			t.Fatalf("ListSnapshots(%+v) = %v, want ErrInvalid", f, err)
		}
	}
}

// Deleting a snapshot (E2B: DELETE /templates/{id}) never breaks the sandboxes created
// from it: running and paused ones (in memory and on disk) keep working.
func TestDeleteSnapshotUsedBySandboxes(t *testing.T) {
	ctx := context.Background()
	for _, mode := range snapModes {
		t.Run(mode.name, func(t *testing.T) {
			h := newHarness(t, mode.opts, nil)
			src := h.create(CreateRequest{Timeout: time.Hour})
			h.inst(src.ID).WriteFile("/data", []byte("v1"))
			info, err := h.o.Snapshot(ctx, src.ID, "snap")
			if err != nil {
				t.Fatal(err)
			}
			memPaused := h.create(CreateRequest{TemplateID: "snap", Secure: true})
			diskPaused := h.create(CreateRequest{TemplateID: "snap", Secure: true})
			running := h.create(CreateRequest{TemplateID: "snap"})
			if err := h.o.Pause(ctx, memPaused.ID, sandbox.PauseOptions{KeepMemory: true}); err != nil {
				t.Fatal(err)
			}
			if err := h.o.Pause(ctx, diskPaused.ID, sandbox.PauseOptions{KeepMemory: false}); err != nil {
				t.Fatal(err)
			}

			if err := h.o.DeleteTemplate(ctx, "snap"); err != nil {
				t.Fatal(err)
			}
			if err := h.o.DeleteTemplate(ctx, info.SnapshotID); !errors.Is(err, ErrTemplateNotFound) {
				t.Fatalf("second delete = %v, want ErrTemplateNotFound", err)
			}
			if _, err := h.o.Create(ctx, CreateRequest{TemplateID: "snap"}); !errors.Is(err, ErrTemplateNotFound) {
				t.Fatalf("create from deleted snapshot = %v", err)
			}
			if !slices.Contains(h.b.DiscardedSnapshots(), src.ID) {
				t.Fatalf("deleted snapshot's capture was not discarded: %v", h.b.DiscardedSnapshots())
			}
			for _, sb := range []*Sandbox{memPaused, diskPaused} {
				got, resumed, err := h.o.Connect(ctx, sb.ID, ConnectOptions{Timeout: time.Minute})
				if err != nil || !resumed || got.EnvdAccessToken != sb.EnvdAccessToken {
					t.Fatalf("resume of %s after delete: %+v %v %v", sb.ID, got, resumed, err)
				}
				if v := h.file(sb.ID, "/data"); v != "v1" {
					t.Fatalf("file after resume = %q", v)
				}
			}
			if h.state(running.ID) != StateRunning {
				t.Fatal("running child affected by the delete")
			}
			// Ordinary templates are deletable the same way; their sandboxes keep running.
			if err := h.o.DeleteTemplate(ctx, "default"); err != nil {
				t.Fatal(err)
			}
			if h.state(src.ID) != StateRunning {
				t.Fatal("source sandbox affected by deleting its template")
			}
			if err := h.o.DeleteTemplate(ctx, "nope"); !errors.Is(err, ErrTemplateNotFound) {
				t.Fatalf("delete unknown = %v", err)
			}
		})
	}
}

func TestCreateFromSnapshotRefusals(t *testing.T) {
	ctx := context.Background()
	h := newHarness(t, snapModes[0].opts, nil)
	put := func(tpl catalog.Template) {
		t.Helper()
		tpl.Kind = catalog.KindSnapshot
		if err := h.cat.Templates().Put(tpl); err != nil {
			t.Fatal(err)
		}
	}
	// A snapshot synced from a node of another kind (a microVM's memory image).
	put(catalog.Template{ID: "other-backend", Backend: "microvm", Artifact: []byte(`{"sourceID":"x","files":{}}`)})
	put(catalog.Template{ID: "corrupt", Backend: "mock", Artifact: []byte(`{"files":{}}`)})
	for _, tc := range []struct {
		tpl  string
		want error
	}{
		{"other-backend", ErrInvalid},
		{"corrupt", nil},
	} {
		_, err := h.o.Create(ctx, CreateRequest{TemplateID: tc.tpl})
		if err == nil || (tc.want != nil && !errors.Is(err, tc.want)) {
			t.Fatalf("create from %s = %v, want %v", tc.tpl, err, tc.want)
		}
		if tc.tpl == "other-backend" && !strings.Contains(err.Error(), "taken on backend microvm, this node runs mock") {
			t.Fatalf("refusal does not say which backends: %v", err)
		}
	}
	if live := h.b.Live(); len(live) != 0 {
		t.Fatalf("instances left behind: %v", live)
	}
	h2 := newHarness(t, mock.Options{}, nil)
	if err := h2.cat.Templates().Put(catalog.Template{ID: "s", Kind: catalog.KindSnapshot, Artifact: []byte(`{}`)}); err != nil {
		t.Fatal(err)
	}
	if _, err := h2.o.Create(ctx, CreateRequest{TemplateID: "s"}); !errors.Is(err, ErrUnsupported) {
		t.Fatalf("create from snapshot without backend support = %v, want ErrUnsupported", err)
	}
}

// TestTemplateRoot: a template's layer stack (catalog.LayerStack in its artifact) is the
// sandbox's root; its directory is added only for a backend that boots directories, and
// a directory-only template is refused, before any launch, by one that does not.
// Snapshots carry their own filesystem.
func TestTemplateRoot(t *testing.T) {
	// errUnreadable: any error (a broken catalog record is a server fault, no sentinel).
	errUnreadable := errors.New("unreadable")
	ctx := context.Background()
	layers := []sandbox.LayerRef{{Path: "/l/0", UUID: "u"}, {Digest: "sha256:01"}}
	for _, tc := range []struct {
		name        string
		layeredOnly bool
		artifact    string
		want        sandbox.RootFS
		wantErr     error
	}{
		{"layered template", false, `{"kind":"x","overlaybd":{"sizeMB":1024,"layers":[{"path":"/l/0","uuid":"u"},{"digest":"sha256:01"}]}}`,
			sandbox.RootFS{LowerDir: "/srv/base", Layers: layers, VirtualSize: 1 << 30}, nil},
		{"directory template", false, ``, sandbox.RootFS{LowerDir: "/srv/base"}, nil},
		{"unreadable artifact", false, `{"overlaybd":7}`, sandbox.RootFS{}, errUnreadable},
		{"layered template, layered-only backend", true, `{"overlaybd":{"sizeMB":1024,"layers":[{"path":"/l/0","uuid":"u"},{"digest":"sha256:01"}]}}`,
			sandbox.RootFS{Layers: layers, VirtualSize: 1 << 30}, nil},
		{"directory template, layered-only backend", true, ``, sandbox.RootFS{}, ErrUnsupported},
	} {
		t.Run(tc.name, func(t *testing.T) {
			opts := snapModes[0].opts
			opts.LayeredOnly = tc.layeredOnly
			h := newHarness(t, opts, nil)
			if err := h.cat.Templates().Put(catalog.Template{ID: "t", Kind: catalog.KindTemplate, RootFSDir: "/srv/base",
				Artifact: json.RawMessage(tc.artifact)}); err != nil {
				t.Fatal(err)
			}
			sb, err := h.o.Create(ctx, CreateRequest{TemplateID: "t"})
			if tc.wantErr != nil {
				if err == nil || (tc.wantErr != errUnreadable && !errors.Is(err, tc.wantErr)) || len(h.b.Launches()) != 0 {
					t.Fatalf("create = %v (launches %d), want %v", err, len(h.b.Launches()), tc.wantErr)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			if got := h.inst(sb.ID).Plan().RootFS; !reflect.DeepEqual(got, tc.want) {
				t.Fatalf("plan rootfs %+v, want %+v", got, tc.want)
			}
			if got := h.stored(sb.ID).Launch.RootFS; !reflect.DeepEqual(got, tc.want) {
				t.Fatalf("recorded rootfs %+v", got)
			}
			if _, err := h.o.Snapshot(ctx, sb.ID, "s"); err != nil {
				t.Fatal(err)
			}
			child := h.create(CreateRequest{TemplateID: "s"})
			if got := h.inst(child.ID).Plan(); got.Kind != sandbox.LaunchFromSnapshot || len(got.RootFS.Layers) != 0 {
				t.Fatalf("create from the snapshot: %+v", got)
			}
		})
	}
}
