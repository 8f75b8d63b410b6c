package server

import (
	"context"
	"fmt"
	"net/http"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/aenv-dev/aenv/internal/orchestrator"
)

// netOrch adds the optional network and log methods to fakeOrch.
type netOrch struct {
	*fakeOrch
	updates   []orchestrator.NetworkUpdate
	logs      []orchestrator.LogEntry
	lastQuery orchestrator.LogQuery
}

func (n *netOrch) UpdateNetwork(_ context.Context, id string, u orchestrator.NetworkUpdate) error {
	n.mu.Lock()
	defer n.mu.Unlock()
	sb, ok := n.sandboxes[id]
	if !ok {
		return fmt.Errorf("%w: %s", orchestrator.ErrNotFound, id)
	}
	n.updates = append(n.updates, u)
	sb.AllowInternet, sb.Egress = u.AllowInternet, u.Egress
	return nil
}

func (n *netOrch) Logs(_ context.Context, id string, q orchestrator.LogQuery) ([]orchestrator.LogEntry, error) {
	n.mu.Lock()
	defer n.mu.Unlock()
	if _, ok := n.sandboxes[id]; !ok {
		return nil, fmt.Errorf("%w: %s", orchestrator.ErrNotFound, id)
	}
	if q.MinLevel != "" && !orchestrator.ValidLogLevel(q.MinLevel) {
		return nil, fmt.Errorf("%w: bad level", orchestrator.ErrInvalid)
	}
	n.lastQuery = q
	return n.logs, nil
}

func newNetEnv(t *testing.T) (*env, *netOrch) {
	t.Helper()
	n := &netOrch{fakeOrch: newFakeOrch()}
	e := newEnv(t, func(o *Options) { o.Orchestrator = n })
	e.orch = n.fakeOrch
	return e, n
}

func TestCreateNetworkRules(t *testing.T) {
	tests := []struct {
		name, path, body string
		status           int
		msg              string
		want             orchestrator.Egress
		private          bool
	}{
		{name: "v2 allow and deny", path: "/v2/sandboxes", status: 201,
			body: `{"templateID":"base","network":{"denyOut":["10.0.0.0/8"," 1.2.3.4"],"allowOut":["1.2.3.5","10.1.2.0/24"]}}`,
			want: orchestrator.Egress{AllowOut: []string{"1.2.3.5/32", "10.1.2.0/24"}, DenyOut: []string{"10.0.0.0/8", "1.2.3.4/32"}}},
		{name: "v1 all traffic", path: "/sandboxes", status: 201,
			body: `{"templateID":"base","network":{"denyOut":["0.0.0.0/0"],"allowPublicTraffic":false}}`,
			want: orchestrator.Egress{DenyOut: []string{"0.0.0.0/0"}}, private: true},
		{name: "unmasked CIDR is canonicalised", path: "/v2/sandboxes", status: 201,
			body: `{"templateID":"base","network":{"denyOut":["192.168.1.7/16","192.168.1.7/16"]}}`,
			want: orchestrator.Egress{DenyOut: []string{"192.168.0.0/16"}}},
		{name: "bad CIDR", path: "/v2/sandboxes", status: 400, msg: `network.denyOut entry "10.0.0.0/33"`,
			body: `{"templateID":"base","network":{"denyOut":["10.0.0.0/33"]}}`},
		{name: "domains in allowOut", path: "/v2/sandboxes", status: 201,
			body: `{"templateID":"base","network":{"allowOut":["API.example.com","*.example.org","1.2.3.4"],"denyOut":["0.0.0.0/0"]}}`,
			want: orchestrator.Egress{AllowOut: []string{"1.2.3.4/32", "api.example.com", "*.example.org"}, DenyOut: []string{"0.0.0.0/0"}}},
		{name: "domain in denyOut", path: "/v2/sandboxes", status: 400, msg: "domain name",
			body: `{"templateID":"base","network":{"denyOut":["api.example.com"]}}`},
		{name: "garbage", path: "/sandboxes", status: 400, msg: "neither an IP address, a CIDR block nor a domain pattern",
			body: `{"templateID":"base","network":{"allowOut":["not an ip"]}}`},
		{name: "bare wildcard", path: "/sandboxes", status: 400, msg: "bare wildcard",
			body: `{"templateID":"base","network":{"allowOut":["*"]}}`},
		{name: "wildcard inside", path: "/sandboxes", status: 400, msg: "not a DNS label",
			body: `{"templateID":"base","network":{"allowOut":["api.*.example.com"]}}`},
		{name: "egress proxy", path: "/v2/sandboxes", status: 201,
			body: `{"templateID":"base","network":{"egressProxy":{"address":"P.example.com:1080","username":"u","password":"p"}}}`},
		{name: "egress proxy without port", path: "/v2/sandboxes", status: 400, msg: "network.egressProxy.address",
			body: `{"templateID":"base","network":{"egressProxy":{"address":"p.example.com"}}}`},
		{name: "egress proxy password alone", path: "/v2/sandboxes", status: 400, msg: "needs a username",
			body: `{"templateID":"base","network":{"egressProxy":{"address":"1.2.3.4:1080","password":"p"}}}`},
		{name: "rules", path: "/v2/sandboxes", status: 201,
			body: `{"templateID":"base","network":{"rules":{"API.example.com":[{"transform":{"headers":{"a":"b"}}}]}}}`},
		{name: "rule bare wildcard", path: "/v2/sandboxes", status: 400, msg: "network.rules key",
			body: `{"templateID":"base","network":{"rules":{"*":[{"transform":{"headers":{"a":"b"}}}]}}}`},
		{name: "rule framing header", path: "/v2/sandboxes", status: 400, msg: "cannot be set by a transform",
			body: `{"templateID":"base","network":{"rules":{"a.example.com":[{"transform":{"headers":{"Content-Length":"1"}}}]}}}`},
		{name: "rule bad header value", path: "/v2/sandboxes", status: 400, msg: "not a valid header value",
			body: `{"templateID":"base","network":{"rules":{"a.example.com":[{"transform":{"headers":{"X-A":"a\r\nb: c"}}}]}}}`},
		{name: "rule keys clash", path: "/v2/sandboxes", status: 400, msg: "appears twice",
			body: `{"templateID":"base","network":{"rules":{"a.example.com":[],"A.example.com":[]}}}`},
		{name: "mask", path: "/v2/sandboxes", status: 201,
			body: `{"templateID":"base","network":{"maskRequestHost":"${PORT}-app.example.com"}}`},
		{name: "bad mask", path: "/v2/sandboxes", status: 400, msg: "maskRequestHost",
			body: `{"templateID":"base","network":{"maskRequestHost":"a b/c"}}`},
		{name: "null egress proxy is absent", path: "/v2/sandboxes", status: 201,
			body: `{"templateID":"base","network":{"egressProxy":null,"rules":{}}}`},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			e := newEnv(t)
			rec := e.do("POST", tc.path, tc.body)
			if tc.status != 201 {
				wantError(t, rec, tc.status, tc.msg)
				if len(e.orch.sandboxes) != 0 {
					t.Fatal("a refused create reached the orchestrator")
				}
				return
			}
			if rec.Code != 201 {
				t.Fatalf("status %d: %s", rec.Code, rec.Body)
			}
			r := e.orch.lastReq
			if !slices.Equal(r.Egress.AllowOut, tc.want.AllowOut) || !slices.Equal(r.Egress.DenyOut, tc.want.DenyOut) || r.Private != tc.private {
				t.Fatalf("request egress %+v private %v, want %+v %v", r.Egress, r.Private, tc.want, tc.private)
			}
		})
	}
}

func TestUpdateNetwork(t *testing.T) {
	e, n := newNetEnv(t)
	e.orch.add(&orchestrator.Sandbox{ID: "sb1", TemplateID: "base", State: orchestrator.StateRunning, AllowInternet: false})

	rec := e.do("PUT", "/sandboxes/sb1/network", `{"allowOut":["8.8.8.8"],"denyOut":["0.0.0.0/0"]}`)
	if rec.Code != http.StatusNoContent || rec.Body.Len() != 0 {
		t.Fatalf("PUT = %d %s", rec.Code, rec.Body)
	}
	if len(n.updates) != 1 || !n.updates[0].AllowInternet ||
		!slices.Equal(n.updates[0].Egress.AllowOut, []string{"8.8.8.8/32"}) || !slices.Equal(n.updates[0].Egress.DenyOut, []string{"0.0.0.0/0"}) {
		t.Fatalf("updates = %+v (omitted allow_internet_access must clear to true)", n.updates)
	}
	detail := decode[map[string]any](t, e.do("GET", "/sandboxes/sb1", ""))
	netw, _ := detail["network"].(map[string]any)
	if fmt.Sprint(netw["allowOut"]) != "[8.8.8.8/32]" || fmt.Sprint(netw["denyOut"]) != "[0.0.0.0/0]" ||
		netw["allowPublicTraffic"] != true || detail["allowInternetAccess"] != true {
		t.Fatalf("detail network = %v, allowInternetAccess = %v", netw, detail["allowInternetAccess"])
	}

	// Rules and a SOCKS5 proxy are reported back, the password never.
	rec = e.do("PUT", "/sandboxes/sb1/network", `{"allowOut":["*.Example.com"],"rules":{"Api.example.com":[{"transform":{"headers":{"Authorization":"Bearer x"}}}]},"egressProxy":{"address":"socks.example.net:1080","username":"u","password":"secret-pw"}}`)
	if rec.Code != http.StatusNoContent {
		t.Fatalf("PUT = %d %s", rec.Code, rec.Body)
	}
	raw := e.do("GET", "/sandboxes/sb1", "").Body.String()
	detail = decode[map[string]any](t, e.do("GET", "/sandboxes/sb1", ""))
	netw, _ = detail["network"].(map[string]any)
	if strings.Contains(raw, "secret-pw") || fmt.Sprint(netw["allowOut"]) != "[*.example.com]" ||
		fmt.Sprint(netw["rules"]) != "map[api.example.com:[map[transform:map[headers:map[Authorization:Bearer x]]]]]" ||
		fmt.Sprint(netw["egressProxy"]) != "map[address:socks.example.net:1080 username:u]" {
		t.Fatalf("detail network = %s", raw)
	}

	rec = e.do("PUT", "/sandboxes/sb1/network", `{"allow_internet_access":false}`)
	if rec.Code != http.StatusNoContent || n.updates[2].AllowInternet || !n.updates[2].Egress.Empty() {
		t.Fatalf("PUT = %d, update %+v", rec.Code, n.updates[2])
	}

	bad := []struct{ name, body, msg string }{
		{"bad IP", `{"denyOut":["300.1.1.1"]}`, "network.denyOut"},
		{"domain in denyOut", `{"denyOut":["*.example.com"]}`, "domain name"},
		{"bad domain", `{"allowOut":["exa mple.com"]}`, "domain pattern"},
		{"proxy", `{"egressProxy":{"address":"p:0"}}`, "egressProxy"},
		{"rules", `{"rules":{"*":[]}}`, "network.rules"},
		{"not JSON", `{`, "not valid JSON"},
		{"no body", ``, "required"},
	}
	for _, tc := range bad {
		t.Run(tc.name, func(t *testing.T) {
			wantError(t, e.do("PUT", "/sandboxes/sb1/network", tc.body), http.StatusBadRequest, tc.msg)
		})
	}
	if len(n.updates) != 3 {
		t.Fatalf("a refused update reached the orchestrator: %+v", n.updates)
	}
	wantError(t, e.do("PUT", "/sandboxes/nope/network", `{}`), http.StatusNotFound, "nope")

	// An orchestrator without network updates answers 501, not a silent 204.
	plain := newEnv(t)
	plain.orch.add(&orchestrator.Sandbox{ID: "sb1", TemplateID: "base", State: orchestrator.StateRunning})
	wantError(t, plain.do("PUT", "/sandboxes/sb1/network", `{}`), http.StatusNotImplemented, "")
}

func TestSandboxLogs(t *testing.T) {
	e, n := newNetEnv(t)
	e.orch.add(&orchestrator.Sandbox{ID: "sb1", TemplateID: "base", State: orchestrator.StatePaused})
	t0 := time.Date(2026, 1, 2, 3, 4, 5, 600e6, time.UTC)
	n.logs = []orchestrator.LogEntry{
		{Time: t0, Level: "info", Message: "sandbox started", Fields: map[string]string{"operation": "create"}},
		{Time: t0.Add(time.Second), Level: "warn", Message: "oops"},
	}

	v1 := decode[map[string][]map[string]any](t, e.do("GET", "/sandboxes/sb1/logs?start=1700000000123&limit=5", ""))
	if len(v1["logs"]) != 2 || v1["logs"][0]["line"] != "sandbox started" || v1["logs"][0]["timestamp"] != "2026-01-02T03:04:05.6Z" ||
		len(v1["logEntries"]) != 2 || v1["logEntries"][1]["level"] != "warn" || fmt.Sprint(v1["logEntries"][1]["fields"]) != "map[]" {
		t.Fatalf("v1 body = %v", v1)
	}
	if q := n.lastQuery; !q.Forward || q.Limit != 5 || q.Cursor.UnixMilli() != 1700000000123 {
		t.Fatalf("v1 query = %+v", q)
	}

	v2 := decode[map[string][]map[string]any](t, e.do("GET", "/v2/sandboxes/sb1/logs?cursor=1700000000999&direction=backward&level=warn&search=oo&limit=7", ""))
	if len(v2["logs"]) != 2 || v2["logs"][0]["message"] != "sandbox started" || fmt.Sprint(v2["logs"][0]["fields"]) != "map[operation:create]" {
		t.Fatalf("v2 body = %v", v2)
	}
	if q := n.lastQuery; q.Forward || q.Limit != 7 || q.MinLevel != "warn" || q.Search != "oo" || q.Cursor.UnixMilli() != 1700000000999 {
		t.Fatalf("v2 query = %+v", q)
	}
	if rec := e.do("GET", "/v2/sandboxes/sb1/logs", ""); rec.Code != 200 || !n.lastQuery.Forward || !n.lastQuery.Cursor.IsZero() {
		t.Fatalf("v2 defaults: %d, query %+v", rec.Code, n.lastQuery)
	}
	wantError(t, e.do("GET", "/v2/sandboxes/sb1/logs?direction=sideways", ""), http.StatusBadRequest, "direction")
	wantError(t, e.do("GET", "/v2/sandboxes/sb1/logs?level=loud", ""), http.StatusBadRequest, "")
	wantError(t, e.do("GET", "/v2/sandboxes/sb1/logs?cursor=abc", ""), http.StatusBadRequest, "")
	wantError(t, e.do("GET", "/v2/sandboxes/sb1/logs?cursor=-1", ""), http.StatusBadRequest, "cursor")
	wantError(t, e.do("GET", "/sandboxes/sb1/logs?limit=-5", ""), http.StatusBadRequest, "limit")
	wantError(t, e.do("GET", "/sandboxes/sb1/logs?start=-5", ""), http.StatusBadRequest, "start")
	wantError(t, e.do("GET", "/sandboxes/nope/logs", ""), http.StatusNotFound, "")
	wantError(t, e.do("GET", "/v2/sandboxes/nope/logs", ""), http.StatusNotFound, "")
	wantError(t, newEnv(t).do("GET", "/sandboxes/sb1/logs", ""), http.StatusNotImplemented, "")
}
