package server

import (
	"encoding/json"
	"errors"
	"fmt"
	"net/http"
	"path/filepath"
	"slices"
	"testing"

	"github.com/aenv-dev/aenv/internal/orchestrator"
	"github.com/aenv-dev/aenv/internal/sandbox"
	"github.com/aenv-dev/aenv/internal/sandbox/mock"
	"github.com/aenv-dev/aenv/internal/server/api"
)

func TestCreateSnapshot(t *testing.T) {
	for _, tc := range []struct {
		name    string
		path    string
		body    string
		snapErr error
		status  int
		names   []string
	}{
		{"named", "/sandboxes/sbx1/snapshots", `{"name":"golden"}`, nil, 201, []string{"golden"}},
		{"no body", "/sandboxes/sbx1/snapshots", "", nil, 201, []string{}},
		{"empty body", "/sandboxes/sbx1/snapshots", `{}`, nil, 201, []string{}},
		{"unknown sandbox", "/sandboxes/nope/snapshots", `{}`, nil, 404, nil},
		{"paused sandbox", "/sandboxes/paused1/snapshots", `{}`, nil, 409, nil},
		{"bad JSON", "/sandboxes/sbx1/snapshots", `{"name":`, nil, 400, nil},
		{"invalid name", "/sandboxes/sbx1/snapshots", `{"name":"a/b"}`, fmt.Errorf("%w: bad name", orchestrator.ErrInvalid), 400, nil},
		{"backend cannot", "/sandboxes/sbx1/snapshots", `{}`, fmt.Errorf("%w: oci", orchestrator.ErrUnsupported), 501, nil},
		{"backend failure", "/sandboxes/sbx1/snapshots", `{}`, errors.New("freeze failed"), 500, nil},
	} {
		t.Run(tc.name, func(t *testing.T) {
			e := newEnv(t)
			e.orch.add(&orchestrator.Sandbox{ID: "sbx1", TemplateID: "base", State: orchestrator.StateRunning})
			e.orch.add(&orchestrator.Sandbox{ID: "paused1", TemplateID: "base", State: orchestrator.StatePaused})
			e.orch.snapErr = tc.snapErr
			rec := e.do("POST", tc.path, tc.body)
			if tc.status != 201 {
				wantError(t, rec, tc.status, "")
				return
			}
			if rec.Code != 201 {
				t.Fatalf("status %d: %s", rec.Code, rec.Body)
			}
			got := decode[api.SnapshotInfo](t, rec)
			if got.SnapshotID == "" || !slices.Equal(got.Names, tc.names) || got.SourceSandboxID == nil || *got.SourceSandboxID != "sbx1" {
				t.Fatalf("body %s", rec.Body)
			}
			// names is required by the SDK: never null.
			if !json200HasKey(rec.Body.Bytes(), "names") {
				t.Fatalf("body without names: %s", rec.Body)
			}
		})
	}
	e := newEnv(t)
	if rec := e.doWith("POST", "/sandboxes/x/snapshots", `{}`, nil); rec.Code != 401 {
		t.Fatalf("without key: %d", rec.Code)
	}
}

func json200HasKey(raw []byte, key string) bool {
	var m map[string]any
	if err := json.Unmarshal(raw, &m); err != nil {
		return false
	}
	v, ok := m[key]
	return ok && v != nil
}

func TestListSnapshotsAndDelete(t *testing.T) {
	e := newEnv(t)
	e.orch.add(&orchestrator.Sandbox{ID: "a", TemplateID: "base", State: orchestrator.StateRunning})
	e.orch.add(&orchestrator.Sandbox{ID: "b", TemplateID: "base", State: orchestrator.StateRunning})
	for i, src := range []string{"a", "b", "a"} {
		if rec := e.do("POST", "/sandboxes/"+src+"/snapshots", fmt.Sprintf(`{"name":"n%d"}`, i)); rec.Code != 201 {
			t.Fatalf("snapshot: %d %s", rec.Code, rec.Body)
		}
	}
	rec := e.do("GET", "/snapshots?limit=2", "")
	if rec.Code != 200 || rec.Header().Get("X-Next-Token") == "" {
		t.Fatalf("page 1: %d next=%q %s", rec.Code, rec.Header().Get("X-Next-Token"), rec.Body)
	}
	page1 := decode[[]api.SnapshotInfo](t, rec)
	rec = e.do("GET", "/snapshots?limit=2&nextToken="+rec.Header().Get("X-Next-Token"), "")
	page2 := decode[[]api.SnapshotInfo](t, rec)
	if rec.Code != 200 || rec.Header().Get("X-Next-Token") != "" || len(page1) != 2 || len(page2) != 1 {
		t.Fatalf("paging: %v / %v (next %q)", page1, page2, rec.Header().Get("X-Next-Token"))
	}
	if page1[0].SnapshotID != "snap3" || page2[0].SnapshotID != "snap1" {
		t.Fatalf("not newest first: %v %v", page1, page2)
	}
	if got := decode[[]api.SnapshotInfo](t, e.do("GET", "/snapshots?sandboxID=b", "")); len(got) != 1 || got[0].SnapshotID != "snap2" {
		t.Fatalf("by sandbox: %+v", got)
	}
	if got := decode[[]api.SnapshotInfo](t, e.do("GET", "/snapshots?name=n2", "")); len(got) != 1 || got[0].SnapshotID != "snap3" {
		t.Fatalf("by name: %+v", got)
	}
	if rec := e.do("GET", "/snapshots?sandboxID=nobody", ""); rec.Code != 200 || rec.Body.String() != "[]\n" {
		t.Fatalf("empty list must be []: %d %q", rec.Code, rec.Body)
	}
	for _, q := range []string{"limit=0", "limit=101", "limit=x", "nextToken=zz"} {
		wantError(t, e.do("GET", "/snapshots?"+q, ""), 400, "")
	}

	for _, step := range []struct {
		path   string
		status int
	}{
		{"/templates/snap1", 204},
		{"/templates/snap1", 404},
		{"/templates/n1", 204}, // by name
		{"/templates/base", 204},
		{"/templates/nope", 404},
	} {
		rec := e.do("DELETE", step.path, "")
		if step.status == 404 {
			wantError(t, rec, 404, "")
			continue
		}
		if rec.Code != step.status {
			t.Fatalf("DELETE %s: %d %s", step.path, rec.Code, rec.Body)
		}
	}
}

func TestForkHandler(t *testing.T) {
	for _, tc := range []struct {
		name      string
		path      string
		body      string
		forkErr   error
		fail      map[int]error
		status    int
		wantCount int
		wantTTL   int
	}{
		{"defaults", "/sandboxes/src/fork", "", nil, nil, 201, 1, 15},
		{"count and timeout", "/sandboxes/src/fork", `{"count":3,"timeout":60}`, nil, nil, 201, 3, 60},
		{"some children fail", "/sandboxes/src/fork", `{"count":3}`, nil,
			map[int]error{1: fmt.Errorf("%w: full", orchestrator.ErrCapacity)}, 201, 3, 15},
		{"count 0", "/sandboxes/src/fork", `{"count":0}`, nil, nil, 400, 0, 0},
		{"count 101", "/sandboxes/src/fork", `{"count":101}`, nil, nil, 400, 0, 0},
		{"count 1000", "/sandboxes/src/fork", `{"count":1000}`, nil, nil, 400, 0, 0},
		{"negative timeout", "/sandboxes/src/fork", `{"timeout":-1}`, nil, nil, 400, 0, 0},
		{"unknown source", "/sandboxes/nope/fork", `{}`, nil, nil, 404, 0, 0},
		{"paused source", "/sandboxes/src/fork", `{}`, fmt.Errorf("%w: paused", orchestrator.ErrConflict), nil, 409, 0, 0},
		{"backend cannot", "/sandboxes/src/fork", `{}`, fmt.Errorf("%w: oci", orchestrator.ErrUnsupported), nil, 501, 0, 0},
	} {
		t.Run(tc.name, func(t *testing.T) {
			e := newEnv(t)
			e.orch.add(&orchestrator.Sandbox{ID: "src", TemplateID: "base", State: orchestrator.StateRunning})
			e.orch.forkErr, e.orch.forkFail = tc.forkErr, tc.fail
			rec := e.do("POST", tc.path, tc.body)
			if tc.status != 201 {
				wantError(t, rec, tc.status, "")
				return
			}
			if rec.Code != 201 {
				t.Fatalf("status %d: %s", rec.Code, rec.Body)
			}
			if e.orch.lastFork != [2]int{tc.wantCount, tc.wantTTL} {
				t.Fatalf("orchestrator got count,timeout = %v, want %d,%d", e.orch.lastFork, tc.wantCount, tc.wantTTL)
			}
			res := decode[[]api.SandboxForkResult](t, rec)
			if len(res) != tc.wantCount {
				t.Fatalf("%d results, want %d", len(res), tc.wantCount)
			}
			for i, r := range res {
				if fe := tc.fail[i]; fe != nil {
					if r.Sandbox != nil || r.Error == nil || r.Error.Code != http.StatusServiceUnavailable || r.Error.Message == "" {
						t.Fatalf("result %d: %+v, want a 503 error", i, r)
					}
					continue
				}
				if r.Error != nil || r.Sandbox == nil || r.Sandbox.SandboxID == "" || r.Sandbox.EnvdAccessToken == nil {
					t.Fatalf("result %d: %+v", i, r)
				}
			}
		})
	}
}

func TestCapabilitiesAndMemoryFlags(t *testing.T) {
	e := newEnv(t)
	e.orch.caps = sandbox.Capabilities{Snapshots: true, PauseKeepsProcesses: true}
	rec := e.do("GET", "/aenv/capabilities", "")
	got := decode[api.NodeCapabilities](t, rec)
	if rec.Code != 200 || got != (api.NodeCapabilities{Backend: "fake", Snapshots: true, PauseKeepsProcesses: true}) {
		t.Fatalf("capabilities %d %+v", rec.Code, got)
	}
	if rec := e.doWith("GET", "/aenv/capabilities", "", nil); rec.Code != 401 {
		t.Fatalf("capabilities without key: %d", rec.Code)
	}

	e.orch.add(&orchestrator.Sandbox{ID: "s", TemplateID: "base", State: orchestrator.StateRunning})
	for _, tc := range []struct {
		body string
		keep bool
	}{{`{"memory":false}`, false}, {`{"memory":true}`, true}, {``, true}} {
		e.orch.sandboxes["s"].State = orchestrator.StateRunning
		if rec := e.do("POST", "/sandboxes/s/pause", tc.body); rec.Code != 204 || e.orch.lastPause.KeepMemory != tc.keep {
			t.Fatalf("pause %q: %d keep=%v", tc.body, rec.Code, e.orch.lastPause.KeepMemory)
		}
	}
	for _, tc := range []struct {
		path, body string
		cold       bool
	}{
		{"/v2/sandboxes/s/connect", `{"memory":false}`, true},
		{"/v2/sandboxes/s/connect", `{"memory":true}`, false},
		{"/v2/sandboxes/s/connect", `{}`, false},
		{"/sandboxes/s/connect", `{"timeout":10,"memory":false}`, true},
	} {
		if rec := e.do("POST", tc.path, tc.body); rec.Code >= 300 || e.orch.lastConnect.ColdBoot != tc.cold {
			t.Fatalf("connect %s %s: %d cold=%v", tc.path, tc.body, rec.Code, e.orch.lastConnect.ColdBoot)
		}
	}
	for _, tc := range []struct {
		body string
		disk bool
	}{
		{`{"templateID":"base","autoPause":true,"autoPauseMemory":false}`, true},
		{`{"templateID":"base","autoPause":true,"autoPauseMemory":true}`, false},
		{`{"templateID":"base","autoPause":true}`, false},
	} {
		if rec := e.do("POST", "/v2/sandboxes", tc.body); rec.Code != 201 || e.orch.lastReq.AutoPauseDisk != tc.disk {
			t.Fatalf("create %s: %d disk=%v", tc.body, rec.Code, e.orch.lastReq.AutoPauseDisk)
		}
	}
}

// TestRealSnapshotFlow drives the SDK's snapshot calls through the handler, the real
// orchestrator and catalog, and the mock backend with snapshots enabled.
func TestRealSnapshotFlow(t *testing.T) {
	e, be := realEnv(t, mock.Options{Capabilities: sandbox.Capabilities{PauseKeepsProcesses: true, Snapshots: true}})
	created := decode[api.Sandbox](t, e.do("POST", "/v2/sandboxes", `{"templateID":"base","timeout":120}`))
	id := created.SandboxID
	be.Instance(id).WriteFile("/home/user/f", []byte("v"))

	rec := e.do("POST", "/sandboxes/"+id+"/snapshots", `{"name":"golden-`+filepath.Base(t.TempDir())+`"}`)
	if rec.Code != 201 {
		t.Fatalf("snapshot: %d %s", rec.Code, rec.Body)
	}
	snap := decode[api.SnapshotInfo](t, rec)
	wantError(t, e.do("POST", "/sandboxes/"+id+"/snapshots", `{"name":"`+snap.Names[0]+`"}`), 409, "")

	list := decode[[]api.SnapshotInfo](t, e.do("GET", "/snapshots?sandboxID="+id, ""))
	if len(list) != 1 || list[0].SnapshotID != snap.SnapshotID {
		t.Fatalf("list: %+v", list)
	}
	for _, ref := range []string{snap.SnapshotID, snap.Names[0]} {
		rec := e.do("POST", "/v2/sandboxes", `{"templateID":"`+ref+`"}`)
		if rec.Code != 201 {
			t.Fatalf("create from %s: %d %s", ref, rec.Code, rec.Body)
		}
		child := decode[api.Sandbox](t, rec)
		if v, _ := be.Instance(child.SandboxID).ReadFile("/home/user/f"); string(v) != "v" || child.TemplateID != snap.SnapshotID {
			t.Fatalf("child %+v sees %q", child, v)
		}
	}
	rec = e.do("POST", "/sandboxes/"+id+"/fork", `{"count":3,"timeout":30}`)
	if rec.Code != 201 {
		t.Fatalf("fork: %d %s", rec.Code, rec.Body)
	}
	for i, r := range decode[[]api.SandboxForkResult](t, rec) {
		if r.Sandbox == nil || r.Error != nil {
			t.Fatalf("fork child %d: %+v", i, r)
		}
		if v, _ := be.Instance(r.Sandbox.SandboxID).ReadFile("/home/user/f"); string(v) != "v" {
			t.Fatalf("fork child %d sees %q", i, v)
		}
	}
	wantError(t, e.do("POST", "/sandboxes/nope/fork", `{}`), 404, "")

	// Pause to disk, connect: same id and token, file kept.
	if rec := e.do("POST", "/sandboxes/"+id+"/pause", `{"memory":false}`); rec.Code != 204 {
		t.Fatalf("pause: %d %s", rec.Code, rec.Body)
	}
	if be.Instance(id) != nil {
		t.Fatal("sandbox paused to disk still has an instance")
	}
	wantError(t, e.do("POST", "/sandboxes/"+id+"/snapshots", `{}`), 409, "")
	rec = e.do("POST", "/v2/sandboxes/"+id+"/connect", `{"timeout":60}`)
	again := decode[api.Sandbox](t, rec)
	if rec.Code != 201 || again.SandboxID != id || *again.EnvdAccessToken != *created.EnvdAccessToken {
		t.Fatalf("connect: %d %s", rec.Code, rec.Body)
	}
	if v, _ := be.Instance(id).ReadFile("/home/user/f"); string(v) != "v" {
		t.Fatalf("file after resume from disk = %q", v)
	}

	if rec := e.do("DELETE", "/templates/"+snap.SnapshotID, ""); rec.Code != 204 {
		t.Fatalf("delete: %d %s", rec.Code, rec.Body)
	}
	wantError(t, e.do("DELETE", "/templates/"+snap.SnapshotID, ""), 404, "")
	caps := decode[api.NodeCapabilities](t, e.do("GET", "/aenv/capabilities", ""))
	if caps.Backend != "mock" || !caps.Snapshots || caps.LiveFork {
		t.Fatalf("capabilities %+v", caps)
	}
}

func TestRealSnapshotUnsupported(t *testing.T) {
	e, _ := realEnv(t, mock.Options{Capabilities: sandbox.Capabilities{PauseKeepsProcesses: true}})
	id := decode[api.Sandbox](t, e.do("POST", "/v2/sandboxes", `{"templateID":"base"}`)).SandboxID
	wantError(t, e.do("POST", "/sandboxes/"+id+"/snapshots", `{}`), 501, "snapshot")
	wantError(t, e.do("POST", "/sandboxes/"+id+"/fork", `{"count":2}`), 501, "fork")
	// memory:false still pauses (in place) and connect resumes.
	if rec := e.do("POST", "/sandboxes/"+id+"/pause", `{"memory":false}`); rec.Code != 204 {
		t.Fatalf("pause: %d %s", rec.Code, rec.Body)
	}
	if rec := e.do("POST", "/v2/sandboxes/"+id+"/connect", `{"memory":false}`); rec.Code != 201 {
		t.Fatalf("connect: %d %s", rec.Code, rec.Body)
	}
}
