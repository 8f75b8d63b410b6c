package server

import (
	"archive/tar"
	"bytes"
	"net/http"
	"net/http/httptest"
	"net/url"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/aenv-dev/aenv/internal/catalog"
	"github.com/aenv-dev/aenv/internal/server/api"
	"github.com/aenv-dev/aenv/internal/template/build"
)

// newTemplateEnv serves the template endpoints with the real builder and catalog; the
// fake orchestrator's creates fail, so builds end in error at the base step (builds
// that succeed are tested with real sandboxes in internal/template/build).
func newTemplateEnv(t *testing.T) (*env, *catalog.Catalog) {
	t.Helper()
	data := t.TempDir()
	cat, err := catalog.Open(filepath.Join(data, "aenv.db"))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { cat.Close() })
	if err := cat.Templates().Put(catalog.Template{ID: "base", Kind: catalog.KindTemplate, RootFSDir: t.TempDir()}); err != nil {
		t.Fatal(err)
	}
	var svc *build.Service
	e := newEnv(t, func(o *Options) {
		svc, err = build.New(build.Config{DataDir: data}, o.Orchestrator.(*fakeOrch), cat.Templates())
		if err != nil {
			t.Fatal(err)
		}
		o.Builds = svc
	})
	t.Cleanup(svc.Close)
	return e, cat
}

func tarOf(t *testing.T, name, body string) []byte {
	t.Helper()
	var buf bytes.Buffer
	tw := tar.NewWriter(&buf)
	tw.WriteHeader(&tar.Header{Name: name, Mode: 0o644, Size: int64(len(body)), Typeflag: tar.TypeReg})
	tw.Write([]byte(body))
	tw.Close()
	return buf.Bytes()
}

func TestTemplateBuildFlow(t *testing.T) {
	e, _ := newTemplateEnv(t)
	rec := e.do("POST", "/v3/templates", `{"name":"my-app:v1","cpuCount":2,"memoryMB":512,"tags":["v1"]}`)
	if rec.Code != http.StatusAccepted {
		t.Fatalf("request: %d %s", rec.Code, rec.Body)
	}
	req := decode[api.TemplateRequestResponseV3](t, rec)
	if req.TemplateID == "" || req.BuildID == "" || req.Names[0] != "my-app" || req.Tags[0] != "v1" {
		t.Fatalf("request body: %s", rec.Body)
	}
	tid, bid := req.TemplateID, req.BuildID

	// Upload protocol: not present → signed URL → PUT → present.
	rec = e.do("GET", "/templates/"+tid+"/files/abc123", "")
	if rec.Code != http.StatusCreated {
		t.Fatalf("files: %d %s", rec.Code, rec.Body)
	}
	up := decode[api.TemplateBuildFileUpload](t, rec)
	if up.Present || up.Url == nil {
		t.Fatalf("files: %s", rec.Body)
	}
	u, err := url.Parse(*up.Url)
	if err != nil || u.Scheme != "http" || u.Host != "example.com" {
		t.Fatalf("upload url %q: %v", *up.Url, err)
	}
	put := func(path string, body []byte) int {
		r := httptest.NewRequest("PUT", path, bytes.NewReader(body))
		w := httptest.NewRecorder()
		e.srv.ServeHTTP(w, r)
		return w.Code
	}
	if code := put(u.RequestURI(), []byte("not a tar")); code != http.StatusBadRequest {
		t.Errorf("garbage upload: %d", code)
	}
	forged := strings.Replace(u.RequestURI(), "token=", "token=x", 1)
	if code := put(forged, tarOf(t, "a.txt", "a")); code != http.StatusUnauthorized {
		t.Errorf("forged token: %d", code)
	}
	if code := put(strings.Replace(u.RequestURI(), "abc123", "abc124", 1), tarOf(t, "a.txt", "a")); code != http.StatusUnauthorized {
		t.Errorf("token for another hash: %d", code)
	}
	if code := put(u.RequestURI(), tarOf(t, "a.txt", "a")); code != http.StatusCreated {
		t.Fatalf("upload: %d", code)
	}
	rec = e.do("GET", "/templates/"+tid+"/files/abc123", "")
	if up := decode[api.TemplateBuildFileUpload](t, rec); !up.Present || up.Url != nil {
		t.Errorf("after upload: %s", rec.Body)
	}
	wantError(t, e.do("GET", "/templates/nope/files/abc123", ""), 404, "not found")
	wantError(t, e.do("GET", "/templates/"+tid+"/files/..%2Fx", ""), 400, "hash")

	// Status before the start: waiting, with the request's log line.
	rec = e.do("GET", "/templates/"+tid+"/builds/"+bid+"/status", "")
	st := decode[api.TemplateBuildInfo](t, rec)
	if rec.Code != 200 || st.Status != api.TemplateBuildStatusWaiting || len(st.LogEntries) != 1 {
		t.Fatalf("status: %d %s", rec.Code, rec.Body)
	}

	// Bad starts change nothing.
	wantError(t, e.do("POST", "/v2/templates/"+tid+"/builds/"+bid, `{"steps":[]}`), 400, "fromImage or fromTemplate")
	wantError(t, e.do("POST", "/v2/templates/"+tid+"/builds/"+bid, `{"fromTemplate":"base","steps":[{"type":"COPY","args":["a.txt","/x"],"filesHash":"zzz"}]}`), 400, "not uploaded")
	wantError(t, e.do("POST", "/v2/templates/"+tid+"/builds/"+bid, `{"fromTemplate":"base","steps":[{"type":"FROB"}]}`), 400, "unsupported step")
	wantError(t, e.do("POST", "/v2/templates/"+tid+"/builds/nope", `{"fromTemplate":"base"}`), 404, "not found")
	wantError(t, e.do("POST", "/v2/templates/other/builds/"+bid, `{"fromTemplate":"base"}`), 404, "not found")

	rec = e.do("POST", "/v2/templates/"+tid+"/builds/"+bid, `{"fromTemplate":"base","startCmd":"x","steps":[{"type":"RUN","args":["echo hi"]},{"type":"COPY","args":["a.txt","/x"],"filesHash":"abc123"}]}`)
	if rec.Code != http.StatusAccepted {
		t.Fatalf("start: %d %s", rec.Code, rec.Body)
	}
	wantError(t, e.do("POST", "/v2/templates/"+tid+"/builds/"+bid, `{"fromTemplate":"base"}`), 409, "conflict: build")

	// The fake orchestrator cannot create the build sandbox: the build fails at "base".
	var info api.TemplateBuildInfo
	deadline := time.Now().Add(10 * time.Second)
	offset := 0
	var all []api.BuildLogEntry
	for {
		rec = e.do("GET", "/templates/"+tid+"/builds/"+bid+"/status?logsOffset="+strconv.Itoa(offset), "")
		info = decode[api.TemplateBuildInfo](t, rec)
		if info.LogsOffset == nil || int(*info.LogsOffset) != offset {
			t.Fatalf("logsOffset = %v, want %d", info.LogsOffset, offset)
		}
		offset += len(info.LogEntries)
		all = append(all, info.LogEntries...)
		if info.Status == api.TemplateBuildStatusError || time.Now().After(deadline) {
			break
		}
		time.Sleep(20 * time.Millisecond)
	}
	if info.Status != api.TemplateBuildStatusError || info.Reason == nil || info.Reason.Step == nil ||
		*info.Reason.Step != "base" || !strings.Contains(info.Reason.Message, "build sandbox") {
		t.Fatalf("final status: %s", rec.Body)
	}
	if info.Reason.LogEntries == nil || len(*info.Reason.LogEntries) == 0 {
		t.Error("reason has no error log entries")
	}
	// Paging through the log with offsets returns every entry exactly once.
	rec = e.do("GET", "/templates/"+tid+"/builds/"+bid+"/status", "")
	if full := decode[api.TemplateBuildInfo](t, rec); len(full.LogEntries) != len(all) || len(full.Logs) != len(all) {
		t.Errorf("paged %d entries, full log has %d", len(all), len(full.LogEntries))
	}
	rec = e.do("GET", "/templates/"+tid+"/builds/"+bid+"/status?logsOffset=1&limit=1&level=error", "")
	if got := decode[api.TemplateBuildInfo](t, rec); len(got.LogEntries) != 0 {
		t.Errorf("level filter on entry 1: %s", rec.Body)
	}
	wantError(t, e.do("GET", "/templates/"+tid+"/builds/"+bid+"/status?logsOffset=-1", ""), 400, "negative")
	wantError(t, e.do("GET", "/templates/"+tid+"/builds/nope/status", ""), 404, "not found")

	// A template whose only build failed is listed and shown with its builds.
	rec = e.do("GET", "/templates", "")
	list := decode[[]api.Template](t, rec)
	if len(list) != 2 || list[1].TemplateID != tid || list[1].BuildStatus != api.TemplateBuildStatusError || list[1].Aliases[0] != "my-app" {
		t.Errorf("list: %s", rec.Body)
	}
	// Resources a template leaves unset (base sets none) are listed as what its sandboxes
	// get, the orchestrator's defaults, not 0; set ones as set.
	if len(list) == 2 && (list[0].CpuCount != 3 || list[0].MemoryMB != 768 || list[1].CpuCount != 2 || list[1].MemoryMB != 512) {
		t.Errorf("list: cpu/memory %d/%d and %d/%d; want the defaults 3/768 and the requested 2/512",
			list[0].CpuCount, list[0].MemoryMB, list[1].CpuCount, list[1].MemoryMB)
	}
	rec = e.do("GET", "/templates/"+tid, "")
	tw := decode[api.TemplateWithBuilds](t, rec)
	if rec.Code != 200 || len(tw.Builds) != 1 || tw.Builds[0].BuildID != bid || tw.Builds[0].FinishedAt == nil {
		t.Errorf("get: %d %s", rec.Code, rec.Body)
	}
	// The failed build registered nothing.
	wantError(t, e.do("GET", "/templates/aliases/my-app", ""), 404, "not found")
	// Requesting the same name again reuses the template id.
	rec = e.do("POST", "/v3/templates", `{"alias":"my-app"}`)
	if again := decode[api.TemplateRequestResponseV3](t, rec); again.TemplateID != tid || again.BuildID == bid {
		t.Errorf("second request: %s", rec.Body)
	}
	// A template whose builds all failed (or never ran) can be deleted, by id or name,
	// and is gone from GET, the list and the build status.
	if rec = e.do("DELETE", "/templates/my-app", ""); rec.Code != http.StatusNoContent {
		t.Fatalf("delete an unbuilt template: %d %s", rec.Code, rec.Body)
	}
	wantError(t, e.do("GET", "/templates/"+tid, ""), 404, "not found")
	wantError(t, e.do("GET", "/templates/"+tid+"/builds/"+bid+"/status", ""), 404, "not found")
	if list := decode[[]api.Template](t, e.do("GET", "/templates", "")); len(list) != 1 {
		t.Errorf("list after delete: %+v", list)
	}
	wantError(t, e.do("DELETE", "/templates/"+tid, ""), 404, "not found")
}

func TestTemplateEndpoints(t *testing.T) {
	e, cat := newTemplateEnv(t)
	if err := cat.Templates().Put(catalog.Template{ID: "t1", Kind: catalog.KindTemplate, Aliases: []string{"py"}, RootFSDir: t.TempDir()}); err != nil {
		t.Fatal(err)
	}
	if err := cat.Templates().Put(catalog.Template{ID: "snap1", Kind: catalog.KindSnapshot}); err != nil {
		t.Fatal(err)
	}
	rec := e.do("GET", "/templates/aliases/py", "")
	if a := decode[api.TemplateAliasResponse](t, rec); rec.Code != 200 || a.TemplateID != "t1" {
		t.Errorf("alias: %d %s", rec.Code, rec.Body)
	}
	wantError(t, e.do("GET", "/templates/aliases/nope", ""), 404, "not found")
	rec = e.do("GET", "/templates/py", "")
	if tw := decode[api.TemplateWithBuilds](t, rec); rec.Code != 200 || tw.TemplateID != "t1" || tw.Builds == nil {
		t.Errorf("get by alias: %d %s", rec.Code, rec.Body)
	}
	wantError(t, e.do("GET", "/templates/nope", ""), 404, "not found")

	// v2 listing pages with X-Next-Token; snapshots are not templates.
	rec = e.do("GET", "/v2/templates?limit=1", "")
	page := decode[[]api.Template](t, rec)
	if len(page) != 1 || rec.Header().Get("X-Next-Token") != "1" {
		t.Fatalf("page 1: %s %v", rec.Body, rec.Header())
	}
	rec = e.do("GET", "/v2/templates?limit=1&nextToken=1", "")
	if page2 := decode[[]api.Template](t, rec); len(page2) != 1 || page2[0].TemplateID != "t1" || rec.Header().Get("X-Next-Token") != "" {
		t.Errorf("page 2: %s %v", rec.Body, rec.Header())
	}
	wantError(t, e.do("GET", "/v2/templates?limit=0", ""), 400, "limit")
	wantError(t, e.do("GET", "/v2/templates?nextToken=x", ""), 400, "nextToken")
	wantError(t, e.do("POST", "/v3/templates", `{}`), 400, "name is required")
	wantError(t, e.do("POST", "/v3/templates", `{"name":"bad/name"}`), 400, "template name")
	wantError(t, e.do("POST", "/v3/templates", `{"name":"snap1"}`), 409, "snapshot")

	// DELETE: templates through the builder; snapshots and unknown names fall through to
	// the orchestrator (the fake answers 404 for what it does not know).
	if rec := e.do("DELETE", "/templates/py", ""); rec.Code != http.StatusNoContent {
		t.Fatalf("delete: %d %s", rec.Code, rec.Body)
	}
	if _, err := cat.Templates().Resolve("t1"); err == nil {
		t.Error("deleted template still in the catalog")
	}
	wantError(t, e.do("DELETE", "/templates/py", ""), 404, "")

	// Without a builder the endpoints say so.
	plain := newEnv(t)
	wantError(t, plain.do("GET", "/templates", ""), 501, "not enabled")
	wantError(t, plain.do("POST", "/v3/templates", `{"name":"x"}`), 501, "not enabled")
	// Unauthenticated control-plane calls are refused; the upload URL needs no key but a token.
	wantError(t, e.doWith("GET", "/templates", "", nil), 401, "API key")
	wantError(t, e.doWith("PUT", "/aenv/uploads/abc?token=x&expires=1", "x", nil), 401, "token")
}

// TestCreateFromTag resolves E2B's "name:tag" through the builder before the
// orchestrator sees the template: an unknown tag is a 404 that names the tag, and the
// create reaches the orchestrator only by template id.
func TestCreateFromTag(t *testing.T) {
	e, cat := newTemplateEnv(t)
	if err := cat.Templates().Put(catalog.Template{ID: "tpl1", Kind: catalog.KindTemplate, Aliases: []string{"app"}, RootFSDir: t.TempDir()}); err != nil {
		t.Fatal(err)
	}
	wantError(t, e.do("POST", "/v2/sandboxes", `{"templateID":"app:v9"}`), 404, `tag "v9"`)
	wantError(t, e.do("POST", "/v2/sandboxes", `{"templateID":"nope:v1"}`), 404, "nope")
}
