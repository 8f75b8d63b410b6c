package server

import (
	"net/http"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/aenv-dev/aenv/internal/catalog"
	"github.com/aenv-dev/aenv/internal/server/api"
)

// requestBuild posts POST /v3/templates and returns the response.
func requestBuild(t *testing.T, e *env, body string) api.TemplateRequestResponseV3 {
	t.Helper()
	rec := e.do("POST", "/v3/templates", body)
	if rec.Code != http.StatusAccepted {
		t.Fatalf("request %s: %d %s", body, rec.Code, rec.Body)
	}
	return decode[api.TemplateRequestResponseV3](t, rec)
}

// waitBuild polls a build's status until it has finished.
func waitBuild(t *testing.T, e *env, tid, bid string) api.TemplateBuildInfo {
	t.Helper()
	deadline := time.Now().Add(30 * time.Second)
	for {
		rec := e.do("GET", "/templates/"+tid+"/builds/"+bid+"/status", "")
		info := decode[api.TemplateBuildInfo](t, rec)
		if info.Status == api.TemplateBuildStatusError || info.Status == api.TemplateBuildStatusReady {
			return info
		}
		if time.Now().After(deadline) {
			t.Fatalf("build %s did not finish: %s", bid, rec.Body)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

func TestTemplateBuildRegistryCredentials(t *testing.T) {
	e, _ := newTemplateEnv(t)
	tests := []struct {
		name, registry string
		status         int
		msg            string
	}{
		{"aws", `{"type":"aws","awsAccessKeyId":"AKIA","awsSecretAccessKey":"s","awsRegion":"us-east-1"}`, 400, "aws registry credentials are not supported"},
		{"gcp", `{"type":"gcp","serviceAccountJson":"{}"}`, 400, "gcp registry credentials are not supported"},
		{"no password", `{"type":"registry","username":"u"}`, 400, "username and a password"},
		{"no type", `{"username":"u","password":"p"}`, 400, "type is required"},
		{"unknown type", `{"type":"azure"}`, 400, `unknown type "azure"`},
		{"with a template", `{"type":"registry","username":"u","password":"p"}`, 400, "need fromImage"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			req := requestBuild(t, e, `{"name":"creds-`+strings.ReplaceAll(tt.name, " ", "-")+`"}`)
			from := `"fromImage":"127.0.0.1:1/private:1"`
			if tt.name == "with a template" {
				from = `"fromTemplate":"base"`
			}
			rec := e.do("POST", "/v2/templates/"+req.TemplateID+"/builds/"+req.BuildID, `{`+from+`,"fromImageRegistry":`+tt.registry+`}`)
			wantError(t, rec, tt.status, tt.msg)
			// A refused start leaves the build waiting, to be started properly.
			if st := decode[api.TemplateBuildInfo](t, e.do("GET", "/templates/"+req.TemplateID+"/builds/"+req.BuildID+"/status", "")); st.Status != api.TemplateBuildStatusWaiting {
				t.Errorf("status after a refused start: %s", st.Status)
			}
		})
	}
	// Accepted credentials are used for the pull (here: a registry that is down) and
	// never show up in the build's log; force is accepted and logged.
	req := requestBuild(t, e, `{"name":"creds-ok"}`)
	rec := e.do("POST", "/v2/templates/"+req.TemplateID+"/builds/"+req.BuildID,
		`{"fromImage":"127.0.0.1:1/private:1","force":true,"fromImageRegistry":{"type":"registry","username":"alice","password":"pa55-secret"},"steps":[{"type":"RUN","args":["true"],"force":true}]}`)
	if rec.Code != http.StatusAccepted {
		t.Fatalf("start: %d %s", rec.Code, rec.Body)
	}
	info := waitBuild(t, e, req.TemplateID, req.BuildID)
	if info.Status != api.TemplateBuildStatusError || info.Reason == nil || deref(info.Reason.Step) != "base" ||
		!strings.Contains(info.Reason.Message, "127.0.0.1:1/private:1") {
		t.Fatalf("build: %+v", info)
	}
	var text strings.Builder
	for _, l := range info.LogEntries {
		text.WriteString(l.Message + "\n")
	}
	if !strings.Contains(text.String(), "registry credentials given with the build (user alice)") || !strings.Contains(text.String(), "force:") {
		t.Errorf("log lacks the credentials or force line:\n%s", text.String())
	}
	if strings.Contains(text.String(), "pa55-secret") || strings.Contains(info.Reason.Message, "pa55-secret") {
		t.Errorf("the password is in the build's log:\n%s", text.String())
	}
}

func TestTemplateTags(t *testing.T) {
	e, _ := newTemplateEnv(t)
	for _, tc := range []struct{ body, want string }{
		{`{"name":"tagged:v2","tags":["prod","v2"]}`, "prod,v2"},
		{`{"name":"untagged"}`, "default"},
		{`{"alias":"older-sdk","tags":["x"]}`, "x"},
	} {
		if got := strings.Join(requestBuild(t, e, tc.body).Tags, ","); got != tc.want {
			t.Errorf("request %s: tags %q, want %q", tc.body, got, tc.want)
		}
	}
	wantError(t, e.do("POST", "/v3/templates", `{"name":"t","tags":["bad tag"]}`), 400, `tag "bad tag"`)
	wantError(t, e.do("POST", "/v3/templates", `{"name":"t:"}`), 400, `tag ""`)

	// "base" is a template without builds, so without tags.
	rec := e.do("GET", "/templates/base/tags", "")
	if tags := decode[[]api.TemplateTag](t, rec); rec.Code != 200 || len(tags) != 0 {
		t.Errorf("tags of base: %d %s", rec.Code, rec.Body)
	}
	wantError(t, e.do("GET", "/templates/nope/tags", ""), 404, "not found")
	wantError(t, e.do("POST", "/templates/tags", `{"target":"base:nope","tags":["a"]}`), 404, `tag "nope"`)
	wantError(t, e.do("POST", "/templates/tags", `{"target":"base","tags":["a"]}`), 404, `tag "default"`)
	wantError(t, e.do("POST", "/templates/tags", `{"target":"nope:v1","tags":["a"]}`), 404, "not found")
	wantError(t, e.do("POST", "/templates/tags", `{"target":"base","tags":[]}`), 400, "no tags")
	wantError(t, e.do("POST", "/templates/tags", `{"target":"base","tags":["a/b"]}`), 400, `tag "a/b"`)
	wantError(t, e.do("DELETE", "/templates/tags", `{"name":"base","tags":["nope"]}`), 404, `tag "nope"`)
	wantError(t, e.do("DELETE", "/templates/tags", `{"name":"base","tags":[]}`), 400, "no tags")
	wantError(t, e.do("DELETE", "/templates/tags", `{"name":"nope","tags":["a"]}`), 404, "not found")
	wantError(t, e.do("DELETE", "/templates/tags", ``), 400, "body")
	// A build that fails gets no tags: its template is not there to hold them.
	req := requestBuild(t, e, `{"name":"fails:v1"}`)
	if rec := e.do("POST", "/v2/templates/"+req.TemplateID+"/builds/"+req.BuildID, `{"fromTemplate":"base"}`); rec.Code != 202 {
		t.Fatalf("start: %d %s", rec.Code, rec.Body)
	}
	if info := waitBuild(t, e, req.TemplateID, req.BuildID); info.Status != api.TemplateBuildStatusError {
		t.Fatalf("build: %+v", info)
	}
	wantError(t, e.do("GET", "/templates/"+req.TemplateID+"/tags", ""), 404, "not found")
}

func TestTemplateBuildLogs(t *testing.T) {
	e, _ := newTemplateEnv(t)
	req := requestBuild(t, e, `{"name":"logs"}`)
	if rec := e.do("POST", "/v2/templates/"+req.TemplateID+"/builds/"+req.BuildID, `{"fromTemplate":"base"}`); rec.Code != 202 {
		t.Fatalf("start: %d %s", rec.Code, rec.Body)
	}
	info := waitBuild(t, e, req.TemplateID, req.BuildID)
	path := "/templates/" + req.TemplateID + "/builds/" + req.BuildID + "/logs"
	get := func(q string) []api.BuildLogEntry {
		t.Helper()
		rec := e.do("GET", path+q, "")
		if rec.Code != 200 {
			t.Fatalf("logs%s: %d %s", q, rec.Code, rec.Body)
		}
		return decode[api.TemplateBuildLogsResponse](t, rec).Logs
	}
	all := get("")
	if len(all) != len(info.LogEntries) || len(all) < 3 {
		t.Fatalf("logs: %d entries, status has %d", len(all), len(info.LogEntries))
	}
	back := get("?direction=backward&limit=1")
	if len(back) != 1 || back[0].Message != all[len(all)-1].Message {
		t.Errorf("newest entry: %+v, want %q", back, all[len(all)-1].Message)
	}
	errs := get("?level=error")
	if len(errs) == 0 {
		t.Error("no error entries in a failed build's log")
	}
	for _, l := range errs {
		if l.Level != api.LogLevelError {
			t.Errorf("level filter let %s through", l.Level)
		}
	}
	future := time.Now().Add(time.Hour).UnixMilli()
	if got := get("?cursor=" + itoa64(future)); len(got) != 0 {
		t.Errorf("entries after a future cursor: %d", len(got))
	}
	if got := get("?direction=backward&cursor=" + itoa64(future)); len(got) != len(all) {
		t.Errorf("entries before a future cursor: %d, want %d", len(got), len(all))
	}
	if got := get("?source=persistent&limit=2"); len(got) != 2 {
		t.Errorf("limit 2: %d entries", len(got))
	}
	wantError(t, e.do("GET", path+"?limit=5000", ""), 400, "limit")
	wantError(t, e.do("GET", path+"?direction=sideways", ""), 400, "direction")
	wantError(t, e.do("GET", path+"?cursor=-1", ""), 400, "cursor")
	wantError(t, e.do("GET", path+"?level=loud", ""), 400, "level")
	wantError(t, e.do("GET", "/templates/"+req.TemplateID+"/builds/nope/logs", ""), 404, "not found")
}

func itoa64(n int64) string { return strconv.FormatInt(n, 10) }

// TestTemplateTagsRoute checks the tags route next to the alias route it overlaps.
func TestTemplateTagsRoute(t *testing.T) {
	e, cat := newTemplateEnv(t)
	if err := cat.Templates().Put(catalog.Template{ID: "t1", Kind: catalog.KindTemplate, Aliases: []string{"tags"}, RootFSDir: t.TempDir()}); err != nil {
		t.Fatal(err)
	}
	// /templates/aliases/tags is the alias "tags", not the tags of a template "aliases".
	rec := e.do("GET", "/templates/aliases/tags", "")
	if a := decode[api.TemplateAliasResponse](t, rec); rec.Code != 200 || a.TemplateID != "t1" {
		t.Errorf("alias tags: %d %s", rec.Code, rec.Body)
	}
	if rec := e.do("GET", "/templates/t1/tags", ""); rec.Code != 200 || strings.TrimSpace(rec.Body.String()) != "[]" {
		t.Errorf("tags of t1: %d %s", rec.Code, rec.Body)
	}
	wantError(t, e.do("GET", "/templates/t1/other", ""), 404, "route not found")
	// Template.exists("name:tag") is true only for a tag the template has.
	wantError(t, e.do("GET", "/templates/aliases/tags:v1", ""), 404, `tag "v1"`)
	wantError(t, e.do("GET", "/templates/aliases/nope:v1", ""), 404, "not found")
	wantError(t, e.doWith("GET", "/templates/t1/tags", "", nil), 401, "API key")
}
