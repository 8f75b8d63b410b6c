package gateway

import (
	"net/http/httptest"
	"testing"
	"time"
)

func TestIsResume(t *testing.T) {
	for _, tc := range []struct {
		method, path string
		want         bool
	}{
		{"POST", "/sandboxes/abc/connect", true},
		{"POST", "/v2/sandboxes/abc/connect", true},
		{"POST", "/sandboxes/abc/resume", true},
		{"POST", "/v2/sandboxes/abc/resume", false},
		{"GET", "/sandboxes/abc/connect", false},
		{"POST", "/sandboxes/abc/pause", false},
		{"POST", "/sandboxes/abcd/connect", false},
		{"POST", "/sandboxes/abc/connect/x", false},
	} {
		if got := isResume(httptest.NewRequest(tc.method, tc.path, nil), "abc"); got != tc.want {
			t.Errorf("isResume(%s %s) = %v, want %v", tc.method, tc.path, got, tc.want)
		}
	}
}

func TestNodeAction(t *testing.T) {
	for _, tc := range []struct {
		path     string
		id       string
		draining bool
		ok       bool
	}{
		{"/nodes/n1/drain", "n1", true, true},
		{"/nodes/n1/undrain", "n1", false, true},
		{"/nodes/n1", "", false, false},
		{"/nodes//drain", "", false, false},
		{"/nodes/n1/reboot", "", false, false},
		{"/nodesx/n1/drain", "", false, false},
	} {
		id, draining, ok := nodeAction(tc.path)
		if ok != tc.ok || (ok && (id != tc.id || draining != tc.draining)) {
			t.Errorf("nodeAction(%s) = %q, %v, %v; want %q, %v, %v", tc.path, id, draining, ok, tc.id, tc.draining, tc.ok)
		}
	}
}

// A connect goes to the sandbox's node while that node is ready; once the node is stale,
// or when no node holds the sandbox, it is placed on another node with the adopt header,
// and the sandbox is bound there.
func TestResumeElsewhere(t *testing.T) {
	f := newFixture(t, "a", "b")
	key := map[string]string{"X-API-Key": "k1"}
	f.beat(t, "a", "sb-a")
	code, body := f.do(t, "POST", "/sandboxes/sb-a/connect", key)
	if code != 200 || body["node"] != "a" || body["adopt"] != "" {
		t.Fatalf("connect with its node ready = %d %v; want node a, no adopt", code, body)
	}
	*f.clock = f.clock.Add(4 * time.Second)
	f.beat(t, "b")
	*f.clock = f.clock.Add(2 * time.Second) // a: 6 s silent (stale), b: 2 s
	code, body = f.do(t, "POST", "/v2/sandboxes/sb-a/connect", key)
	if code != 200 || body["node"] != "b" || body["adopt"] != "1" {
		t.Fatalf("connect with its node stale = %d %v; want node b with adopt", code, body)
	}
	if l, err := f.state.Lookup("sb-a"); err != nil || l.Node.Id != "b" {
		t.Fatalf("after the resume elsewhere the sandbox is bound to %v (%v), want b", l.GetNode().GetId(), err)
	}
	code, body = f.do(t, "POST", "/sandboxes/sb-unknown/resume", key)
	if code != 200 || body["node"] != "b" || body["adopt"] != "1" {
		t.Fatalf("resume of a sandbox no node holds = %d %v; want an adoption on b", code, body)
	}
}
