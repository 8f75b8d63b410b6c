package server

import (
	"encoding/json"
	"fmt"
	"io"
	"net/http/httptest"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/aenv-dev/aenv/internal/orchestrator"
)

const testKey = "e2b_0123456789abcdef0123456789abcdef01234567"

type env struct {
	t    *testing.T
	orch *fakeOrch
	srv  *Server
	reg  *prometheus.Registry
}

func newEnv(t *testing.T, opts ...func(*Options)) *env {
	t.Helper()
	f := newFakeOrch()
	reg := prometheus.NewRegistry()
	o := Options{Orchestrator: f, Auth: fakeAuth{key: testKey}, Registry: reg}
	for _, fn := range opts {
		fn(&o)
	}
	s, err := New(o)
	if err != nil {
		t.Fatal(err)
	}
	return &env{t: t, orch: f, srv: s, reg: reg}
}

// do sends a control-plane request with the test API key.
func (e *env) do(method, path, body string) *httptest.ResponseRecorder {
	return e.doWith(method, path, body, map[string]string{"X-API-Key": testKey})
}

func (e *env) doWith(method, path, body string, hdr map[string]string) *httptest.ResponseRecorder {
	e.t.Helper()
	var rd io.Reader
	if body != "" {
		rd = strings.NewReader(body)
	}
	req := httptest.NewRequest(method, path, rd)
	if body != "" {
		req.Header.Set("Content-Type", "application/json")
	}
	for k, v := range hdr {
		req.Header.Set(k, v)
		if k == "Host" {
			req.Host = v
		}
	}
	rec := httptest.NewRecorder()
	e.srv.ServeHTTP(rec, req)
	return rec
}

// wantError checks the E2B error shape: JSON {"code": status, "message": non-empty}.
func wantError(t *testing.T, rec *httptest.ResponseRecorder, status int, msgPart string) {
	t.Helper()
	if rec.Code != status {
		t.Fatalf("status = %d, want %d (body %s)", rec.Code, status, rec.Body)
	}
	if ct := rec.Header().Get("Content-Type"); !strings.HasPrefix(ct, "application/json") {
		t.Fatalf("Content-Type = %q, want JSON", ct)
	}
	var body struct {
		Code    int    `json:"code"`
		Message string `json:"message"`
	}
	if err := json.Unmarshal(rec.Body.Bytes(), &body); err != nil {
		t.Fatalf("error body is not JSON: %s", rec.Body)
	}
	if body.Code != status || body.Message == "" {
		t.Fatalf("error body = %s, want code %d and a message", rec.Body, status)
	}
	if msgPart != "" && !strings.Contains(body.Message, msgPart) {
		t.Fatalf("message %q does not mention %q", body.Message, msgPart)
	}
}

func decode[T any](t *testing.T, rec *httptest.ResponseRecorder) T {
	t.Helper()
	var v T
	if err := json.Unmarshal(rec.Body.Bytes(), &v); err != nil {
		t.Fatalf("decode %s: %v", rec.Body, err)
	}
	return v
}

func TestAuth(t *testing.T) {
	e := newEnv(t)
	tests := []struct {
		name, method, path string
		hdr                map[string]string
		want               int
	}{
		{"no key", "GET", "/v2/sandboxes", nil, 401},
		{"wrong key", "GET", "/v2/sandboxes", map[string]string{"X-API-Key": "e2b_wrong"}, 401},
		{"bearer is not accepted", "GET", "/v2/sandboxes", map[string]string{"Authorization": "Bearer " + testKey}, 401},
		{"good key", "GET", "/v2/sandboxes", map[string]string{"X-API-Key": testKey}, 200},
		{"lower-case header", "GET", "/v2/sandboxes", map[string]string{"x-api-key": testKey}, 200},
		{"kill without key", "DELETE", "/sandboxes/x", nil, 401},
		{"create without key", "POST", "/v2/sandboxes", nil, 401},
		{"health is public", "GET", "/health", nil, 204},
		{"metrics is public", "GET", "/metrics", nil, 200},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			rec := e.doWith(tt.method, tt.path, "", tt.hdr)
			if tt.want == 401 {
				wantError(t, rec, 401, "API key")
				return
			}
			if rec.Code != tt.want {
				t.Fatalf("status = %d, want %d: %s", rec.Code, tt.want, rec.Body)
			}
		})
	}
}

func TestCreate(t *testing.T) {
	tests := []struct {
		name      string
		path      string
		body      string
		setup     func(*fakeOrch)
		status    int
		msg       string
		check     func(t *testing.T, f *fakeOrch, body map[string]any)
		wantToken bool
	}{
		{name: "v2 bare create uses 300 s", path: "/v2/sandboxes", body: `{"templateID":"base"}`, status: 201, wantToken: true,
			check: func(t *testing.T, f *fakeOrch, _ map[string]any) {
				if f.lastReq.Timeout != 300*time.Second || !f.lastReq.Secure || !f.lastReq.AllowInternet {
					t.Fatalf("request = %+v", f.lastReq)
				}
			}},
		{name: "v2 full body", path: "/v2/sandboxes", status: 201, wantToken: true,
			body: `{"templateID":"base","metadata":{"user":"a b"},"envVars":{"FOO":"bar"},"timeout":120,"autoPause":true,"autoResume":{"enabled":true},"allow_internet_access":false,"mcp":{"x":1}}`,
			check: func(t *testing.T, f *fakeOrch, _ map[string]any) {
				r := f.lastReq
				if r.Timeout != 120*time.Second || r.Metadata["user"] != "a b" || r.EnvVars["FOO"] != "bar" ||
					!r.AutoPause || !r.AutoResume || r.AllowInternet {
					t.Fatalf("request = %+v", r)
				}
			}},
		{name: "v1 defaults to 15 s and no token", path: "/sandboxes", body: `{"templateID":"base"}`, status: 201,
			check: func(t *testing.T, f *fakeOrch, _ map[string]any) {
				if f.lastReq.Timeout != 15*time.Second || f.lastReq.Secure {
					t.Fatalf("request = %+v", f.lastReq)
				}
			}},
		{name: "v1 secure", path: "/sandboxes", body: `{"templateID":"base","secure":true,"timeout":300}`, status: 201, wantToken: true},
		{name: "resources extension", path: "/v2/sandboxes", body: `{"templateID":"base","cpuCount":4,"memoryMB":1024}`, status: 201, wantToken: true,
			check: func(t *testing.T, f *fakeOrch, _ map[string]any) {
				if f.lastReq.Resources.CPUCount != 4 || f.lastReq.Resources.MemoryMB != 1024 {
					t.Fatalf("resources = %+v", f.lastReq.Resources)
				}
			}},
		{name: "unknown template", path: "/v2/sandboxes", body: `{"templateID":"nope"}`, status: 404, msg: "nope"},
		{name: "missing templateID", path: "/v2/sandboxes", body: `{"timeout":10}`, status: 400, msg: "templateID is required"},
		{name: "empty body", path: "/v2/sandboxes", body: "", status: 400, msg: "body is required"},
		{name: "not JSON", path: "/v2/sandboxes", body: `{templateID:`, status: 400, msg: "not valid JSON"},
		{name: "wrong type", path: "/v2/sandboxes", body: `{"templateID":"base","timeout":"long"}`, status: 400, msg: "timeout"},
		{name: "negative timeout", path: "/v2/sandboxes", body: `{"templateID":"base","timeout":-5}`, status: 400, msg: "timeout must be between"},
		{name: "timeout above max", path: "/v2/sandboxes", body: `{"templateID":"base","timeout":90000}`, status: 400, msg: "timeout must be between"},
		{name: "zero cpu", path: "/v2/sandboxes", body: `{"templateID":"base","cpuCount":0}`, status: 400, msg: "cpuCount"},
		{name: "tiny memory", path: "/sandboxes", body: `{"templateID":"base","memoryMB":1}`, status: 400, msg: "memoryMB"},
		{name: "bad env key", path: "/v2/sandboxes", body: `{"templateID":"base","envVars":{"A=B":"c"}}`, status: 400, msg: "envVars"},
		{name: "memory above what the node can give", path: "/v2/sandboxes", body: `{"templateID":"base","memoryMB":100000000}`, status: 400,
			msg: "memoryMB 100000000 is more than this node can ever give a sandbox: the limit is 16384 MB"},
		{name: "cpus above what the node can give", path: "/sandboxes", body: `{"templateID":"base","cpuCount":9}`, status: 400,
			msg: "cpuCount 9 is more than this node can ever give a sandbox: the limit is 8"},
		{name: "env var of 200 KB", path: "/v2/sandboxes", body: `{"templateID":"base","envVars":{"BIG":"` + strings.Repeat("x", 200<<10) + `"}}`,
			status: 400, msg: "limit is 65536 bytes per variable"},
		{name: "env vars of 320 KB together", path: "/v2/sandboxes", body: envBody(5, 64<<10-8), status: 400, msg: "envVars total"},
		{name: "env value with NUL", path: "/v2/sandboxes", body: `{"templateID":"base","envVars":{"A":"b\u0000c"}}`, status: 400, msg: "NUL"},
		{name: "metadata key of 300 bytes", path: "/v2/sandboxes", body: `{"templateID":"base","metadata":{"` + strings.Repeat("k", 300) + `":"v"}}`,
			status: 400, msg: "the limit is 256"},
		{name: "metadata of 70 KB", path: "/v2/sandboxes", body: `{"templateID":"base","metadata":{"k":"` + strings.Repeat("v", 70<<10) + `"}}`,
			status: 400, msg: "metadata total"},
		{name: "env vars within the limits", path: "/v2/sandboxes", body: envBody(3, 64<<10-8), status: 201, wantToken: true,
			check: func(t *testing.T, f *fakeOrch, _ map[string]any) {
				if len(f.lastReq.EnvVars) != 3 {
					t.Fatalf("env vars = %d", len(f.lastReq.EnvVars))
				}
			}},
		{name: "private sandbox gets a traffic token", path: "/v2/sandboxes", body: `{"templateID":"base","network":{"allowPublicTraffic":false}}`, status: 201, wantToken: true,
			check: func(t *testing.T, f *fakeOrch, body map[string]any) {
				if !f.lastReq.Private || body["trafficAccessToken"] == nil || body["trafficAccessToken"] == "" {
					t.Fatalf("private=%v trafficAccessToken=%v", f.lastReq.Private, body["trafficAccessToken"])
				}
			}},
		{name: "public network config accepted", path: "/v2/sandboxes", body: `{"templateID":"base","network":{"allowPublicTraffic":true,"allowOut":["1.1.1.1"]}}`, status: 201, wantToken: true,
			check: func(t *testing.T, f *fakeOrch, body map[string]any) {
				if f.lastReq.Private || body["trafficAccessToken"] != nil {
					t.Fatalf("private=%v trafficAccessToken=%v", f.lastReq.Private, body["trafficAccessToken"])
				}
			}},
		{name: "capacity", path: "/v2/sandboxes", body: `{"templateID":"base"}`, status: 503,
			setup: func(f *fakeOrch) { f.createErr = orchestrator.ErrCapacity }},
		{name: "orchestrator invalid", path: "/v2/sandboxes", body: `{"templateID":"base"}`, status: 400,
			setup: func(f *fakeOrch) { f.createErr = orchestrator.ErrInvalid }},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			e := newEnv(t, func(o *Options) { o.Capacity = orchestrator.Capacity{CPUCount: 8, MemoryMB: 16384, DiskSizeMB: 100000} })
			if tt.setup != nil {
				tt.setup(e.orch)
			}
			before := len(e.orch.sandboxes)
			rec := e.do("POST", tt.path, tt.body)
			if tt.status != 201 {
				wantError(t, rec, tt.status, tt.msg)
				if len(e.orch.sandboxes) != before {
					t.Fatal("a rejected create changed state")
				}
				return
			}
			if rec.Code != 201 {
				t.Fatalf("status = %d: %s", rec.Code, rec.Body)
			}
			body := decode[map[string]any](t, rec)
			for _, k := range []string{"sandboxID", "templateID", "clientID", "envdVersion", "domain"} {
				if _, ok := body[k]; !ok {
					t.Fatalf("response lacks %q: %s", k, rec.Body)
				}
			}
			if body["clientID"] != "" || body["domain"] != nil || body["envdVersion"] != "0.5.15" {
				t.Fatalf("body = %s", rec.Body)
			}
			if _, has := body["envdAccessToken"]; has != tt.wantToken {
				t.Fatalf("envdAccessToken present = %v, want %v: %s", has, tt.wantToken, rec.Body)
			}
			if tt.check != nil {
				tt.check(t, e.orch, body)
			}
		})
	}
}

func TestCreateReportsConfiguredDomain(t *testing.T) {
	e := newEnv(t, func(o *Options) { o.Domains = []string{"sbx.example.com"} })
	rec := e.do("POST", "/v2/sandboxes", `{"templateID":"base"}`)
	if body := decode[map[string]any](t, rec); body["domain"] != "sbx.example.com" {
		t.Fatalf("domain = %v", body["domain"])
	}
}

func TestConnectAndResume(t *testing.T) {
	tests := []struct {
		name, path, body string
		state            orchestrator.State
		status           int
		ttl              time.Duration
		msg              string
	}{
		{"v2 running extends", "/v2/sandboxes/a/connect", `{"timeout":90}`, orchestrator.StateRunning, 200, 90 * time.Second, ""},
		{"v2 empty body defaults to 300 s", "/v2/sandboxes/a/connect", "", orchestrator.StateRunning, 200, 300 * time.Second, ""},
		{"v2 paused resumes", "/v2/sandboxes/a/connect", `{}`, orchestrator.StatePaused, 201, 300 * time.Second, ""},
		{"v2 memory flag accepted", "/v2/sandboxes/a/connect", `{"memory":false}`, orchestrator.StatePaused, 201, 300 * time.Second, ""},
		{"v1 running", "/sandboxes/a/connect", `{"timeout":60}`, orchestrator.StateRunning, 200, 60 * time.Second, ""},
		{"v1 paused", "/sandboxes/a/connect", `{"timeout":60}`, orchestrator.StatePaused, 201, 60 * time.Second, ""},
		{"v1 requires timeout", "/sandboxes/a/connect", `{}`, orchestrator.StatePaused, 400, 0, "timeout is required"},
		{"v1 requires body", "/sandboxes/a/connect", ``, orchestrator.StatePaused, 400, 0, "body is required"},
		{"bad timeout", "/v2/sandboxes/a/connect", `{"timeout":0}`, orchestrator.StatePaused, 400, 0, "timeout"},
		{"unknown", "/v2/sandboxes/zzz/connect", `{}`, orchestrator.StateRunning, 404, 0, ""},
		{"resume paused", "/sandboxes/a/resume", `{"timeout":30}`, orchestrator.StatePaused, 201, 30 * time.Second, ""},
		{"resume running is a conflict", "/sandboxes/a/resume", ``, orchestrator.StateRunning, 409, 0, "already running"},
		{"resume unknown", "/sandboxes/zzz/resume", ``, orchestrator.StatePaused, 404, 0, ""},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			e := newEnv(t)
			e.orch.add(&orchestrator.Sandbox{ID: "a", TemplateID: "base", State: tt.state, EnvdAccessToken: "tok-a"})
			rec := e.do("POST", tt.path, tt.body)
			if tt.status >= 400 {
				wantError(t, rec, tt.status, tt.msg)
				return
			}
			if rec.Code != tt.status {
				t.Fatalf("status = %d, want %d: %s", rec.Code, tt.status, rec.Body)
			}
			body := decode[map[string]any](t, rec)
			if body["sandboxID"] != "a" || body["envdAccessToken"] != "tok-a" {
				t.Fatalf("connect must keep id and token: %s", rec.Body)
			}
			if e.orch.lastTTL != tt.ttl {
				t.Fatalf("ttl = %v, want %v", e.orch.lastTTL, tt.ttl)
			}
		})
	}
}

func TestPauseKillTimeoutRefresh(t *testing.T) {
	e := newEnv(t)
	e.orch.add(&orchestrator.Sandbox{ID: "a", TemplateID: "base", State: orchestrator.StateRunning})
	steps := []struct {
		name, method, path, body string
		status                   int
		ttl                      time.Duration
	}{
		{"timeout", "POST", "/sandboxes/a/timeout", `{"timeout":60}`, 204, 60 * time.Second},
		{"timeout may expire now", "POST", "/sandboxes/a/timeout", `{"timeout":-1}`, 204, -time.Second},
		{"timeout requires a value", "POST", "/sandboxes/a/timeout", `{}`, 400, 0},
		{"timeout above max", "POST", "/sandboxes/a/timeout", `{"timeout":999999}`, 400, 0},
		{"timeout unknown", "POST", "/sandboxes/zzz/timeout", `{"timeout":60}`, 404, 0},
		{"refresh", "POST", "/sandboxes/a/refreshes", `{"duration":120}`, 204, 120 * time.Second},
		{"refresh default", "POST", "/sandboxes/a/refreshes", ``, 204, 300 * time.Second},
		{"refresh too long", "POST", "/sandboxes/a/refreshes", `{"duration":3601}`, 400, 0},
		{"refresh unknown", "POST", "/sandboxes/zzz/refreshes", `{}`, 404, 0},
		{"pause", "POST", "/sandboxes/a/pause", `{}`, 204, 0},
		{"pause twice", "POST", "/sandboxes/a/pause", `{}`, 409, 0},
		{"pause unknown", "POST", "/sandboxes/zzz/pause", ``, 404, 0},
		{"kill paused", "DELETE", "/sandboxes/a", ``, 204, 0},
		{"kill again", "DELETE", "/sandboxes/a", ``, 404, 0},
		{"get killed", "GET", "/sandboxes/a", ``, 404, 0},
	}
	for _, s := range steps {
		e.orch.lastTTL = 0
		rec := e.do(s.method, s.path, s.body)
		if s.status >= 400 {
			t.Run(s.name, func(t *testing.T) { wantError(t, rec, s.status, "") })
			continue
		}
		if rec.Code != s.status || rec.Body.Len() != 0 {
			t.Fatalf("%s: status = %d body %q, want %d and no body", s.name, rec.Code, rec.Body, s.status)
		}
		if s.ttl != 0 && e.orch.lastTTL != s.ttl {
			t.Fatalf("%s: ttl = %v, want %v", s.name, e.orch.lastTTL, s.ttl)
		}
	}
}

func TestGetSandbox(t *testing.T) {
	e := newEnv(t)
	start := time.Date(2026, 1, 2, 3, 4, 5, 0, time.UTC)
	e.orch.add(&orchestrator.Sandbox{ID: "p", TemplateID: "base", State: orchestrator.StatePaused, StartedAt: start,
		EndAt: start.Add(time.Minute), Metadata: map[string]string{"k": "v"}, AutoPause: true, EnvdAccessToken: "t"})
	rec := e.do("GET", "/sandboxes/p", "")
	if rec.Code != 200 {
		t.Fatalf("status %d: %s", rec.Code, rec.Body)
	}
	body := decode[map[string]any](t, rec)
	want := map[string]any{"sandboxID": "p", "state": "paused", "clientID": "", "startedAt": "2026-01-02T03:04:05Z",
		"endAt": "2026-01-02T03:05:05Z", "envdVersion": "0.5.15", "envdAccessToken": "t"}
	for k, v := range want {
		if body[k] != v {
			t.Errorf("%s = %v, want %v", k, body[k], v)
		}
	}
	for _, k := range []string{"cpuCount", "memoryMB", "diskSizeMB", "templateID"} {
		if _, ok := body[k]; !ok {
			t.Errorf("missing required %s", k)
		}
	}
	lc, _ := body["lifecycle"].(map[string]any)
	if lc["onTimeout"] != "pause" {
		t.Errorf("lifecycle = %v", body["lifecycle"])
	}
	wantError(t, e.do("GET", "/sandboxes/nope", ""), 404, "")
}

func TestUnknownRouteIsJSON(t *testing.T) {
	e := newEnv(t)
	wantError(t, e.do("GET", "/nope", ""), 404, "route not found")
	rec := e.do("PATCH", "/sandboxes/a", "")
	wantError(t, rec, 405, "not allowed")
	if got := rec.Header().Get("Allow"); got != "GET, HEAD, DELETE" {
		t.Errorf("Allow = %q", got)
	}
}

func TestSandboxMetrics(t *testing.T) {
	e := newEnv(t)
	e.orch.add(&orchestrator.Sandbox{ID: "a", State: orchestrator.StateRunning})
	rec := e.do("GET", "/sandboxes/a/metrics", "")
	got := decode[[]map[string]any](t, rec)
	if len(got) != 2 {
		t.Fatalf("metrics = %s", rec.Body)
	}
	for _, k := range []string{"timestamp", "timestampUnix", "cpuCount", "cpuUsedPct", "memUsed", "memTotal", "memCache", "diskUsed", "diskTotal"} {
		if _, ok := got[0][k]; !ok {
			t.Fatalf("metric lacks %s: %s", k, rec.Body)
		}
	}
	now := e.orch.now.Unix()
	rec = e.do("GET", "/sandboxes/a/metrics?start="+strconv.FormatInt(now-1, 10), "")
	if got := decode[[]map[string]any](t, rec); len(got) != 1 {
		t.Fatalf("start filter: %s", rec.Body)
	}
	wantError(t, e.do("GET", "/sandboxes/a/metrics?start=abc", ""), 400, "start")
	wantError(t, e.do("GET", "/sandboxes/a/metrics?start=10&end=5", ""), 400, "end")
	wantError(t, e.do("GET", "/sandboxes/zzz/metrics", ""), 404, "")

	rec = e.do("GET", "/sandboxes/metrics?sandbox_ids=a,zzz", "")
	many := decode[map[string]map[string]map[string]any](t, rec)
	if len(many["sandboxes"]) != 1 || many["sandboxes"]["a"]["memUsed"] != float64(20) {
		t.Fatalf("sandboxes metrics = %s", rec.Body)
	}
	wantError(t, e.do("GET", "/sandboxes/metrics", ""), 400, "sandbox_ids")
	ids := strings.Repeat("x,", 101)
	wantError(t, e.do("GET", "/sandboxes/metrics?sandbox_ids="+ids[:len(ids)-1], ""), 400, "at most")
}

func TestHTTPMetricsRecorded(t *testing.T) {
	e := newEnv(t)
	e.do("GET", "/sandboxes/zzz", "")
	rec := e.doWith("GET", "/metrics", "", nil)
	body := rec.Body.String()
	if !strings.Contains(body, `aenv_http_request_duration_seconds_count{method="GET",route="GET /sandboxes/{sandboxID}",route_source="control_plane",status="4xx"} 1`) {
		t.Fatalf("request not recorded:\n%s", body)
	}
}

// envBody is a create whose n environment variables are each size bytes as NAME=value.
func envBody(n, size int) string {
	var b strings.Builder
	b.WriteString(`{"templateID":"base","envVars":{`)
	for i := range n {
		if i > 0 {
			b.WriteString(",")
		}
		name := fmt.Sprintf("V%05d", i)
		fmt.Fprintf(&b, "%q:%q", name, strings.Repeat("x", size-len(name)-1))
	}
	b.WriteString("}}")
	return b.String()
}
