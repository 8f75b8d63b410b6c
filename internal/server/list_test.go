package server

import (
	"fmt"
	"maps"
	"net/url"
	"strings"
	"testing"
	"time"

	"github.com/aenv-dev/aenv/internal/orchestrator"
)

func TestDecodeMetadataFilter(t *testing.T) {
	tests := []struct {
		name    string
		query   string // the raw query string as sent on the wire
		want    map[string]string
		wantErr string
	}{
		// §1.6 worked example: JS sends user%3Da%252520b for {user: "a b"}.
		{"JS worked example", "metadata=user%3Da%252520b", map[string]string{"user": "a b"}, ""},
		// Python encodes one level less.
		{"python encoding", "metadata=user%3Da%2520b", map[string]string{"user": "a b"}, ""},
		// JS: encodeURIComponent per key/value, URLSearchParams (escapes again), then the URL.
		{"two pairs with reserved characters", "metadata=" + url.QueryEscape("a=1&b="+url.QueryEscape(url.QueryEscape("x&y=z"))), map[string]string{"a": "1", "b": "x&y=z"}, ""},
		{"missing value", "metadata=" + url.QueryEscape("novalue"), nil, "key=value"},
		{"extra equals", "metadata=" + url.QueryEscape("a=b=c"), nil, "key=value"},
		{"empty key", "metadata=" + url.QueryEscape("=v"), nil, "empty key"},
		{"bad escape", "metadata=a%3D%25zz", nil, "not URL-encoded"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			q, err := url.ParseQuery(tt.query)
			if err != nil {
				t.Fatal(err)
			}
			got, err := decodeMetadataFilter(q.Get("metadata"))
			if tt.wantErr != "" {
				if err == nil || !strings.Contains(err.Error(), tt.wantErr) {
					t.Fatalf("err = %v, want %q", err, tt.wantErr)
				}
				return
			}
			if err != nil || !maps.Equal(got, tt.want) {
				t.Fatalf("got %v, %v; want %v", got, err, tt.want)
			}
		})
	}
}

// listEnv has 5 running sandboxes (one with metadata user="a b") and 2 paused ones.
func listEnv(t *testing.T) *env {
	e := newEnv(t)
	base := time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC)
	for i := range 7 {
		sb := &orchestrator.Sandbox{ID: fmt.Sprintf("s%d", i), TemplateID: "base", State: orchestrator.StateRunning,
			StartedAt: base.Add(time.Duration(i) * time.Minute), EndAt: base.Add(time.Hour)}
		if i >= 5 {
			sb.State = orchestrator.StatePaused
		}
		if i == 2 || i == 6 {
			sb.Metadata = map[string]string{"user": "a b"}
		}
		if i == 3 {
			sb.TemplateID = "other"
		}
		e.orch.add(sb)
	}
	return e
}

func ids(t *testing.T, e *env, path string) ([]string, string) {
	t.Helper()
	rec := e.do("GET", path, "")
	if rec.Code != 200 {
		t.Fatalf("GET %s: %d %s", path, rec.Code, rec.Body)
	}
	var out []string
	for _, it := range decode[[]map[string]any](t, rec) {
		out = append(out, it["sandboxID"].(string)+":"+it["state"].(string))
	}
	return out, rec.Header().Get("X-Next-Token")
}

func TestListV2(t *testing.T) {
	e := listEnv(t)
	tests := []struct {
		name, query string
		want        string
	}{
		{"default is running and paused, newest first", "", "s6:paused s5:paused s4:running s3:running s2:running s1:running s0:running"},
		{"state running", "?state=running", "s4:running s3:running s2:running s1:running s0:running"},
		{"state csv", "?state=running,paused&limit=2", "s6:paused s5:paused"},
		{"metadata (JS encoding)", "?metadata=user%3Da%252520b&state=running,paused", "s6:paused s2:running"},
		{"template", "?template=other", "s3:running"},
		{"ascending", "?order=asc&state=paused", "s5:paused s6:paused"},
		{"startedAfter inclusive", "?startedAfter=2026-01-01T00:05:00Z", "s6:paused s5:paused"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			got, _ := ids(t, e, "/v2/sandboxes"+tt.query)
			if strings.Join(got, " ") != tt.want {
				t.Fatalf("got %v, want %s", got, tt.want)
			}
		})
	}
}

func TestListV2Paging(t *testing.T) {
	e := listEnv(t)
	var all []string
	path := "/v2/sandboxes?limit=3"
	for pages := 0; ; pages++ {
		if pages > 5 {
			t.Fatal("paging does not end")
		}
		got, next := ids(t, e, path)
		all = append(all, got...)
		if next == "" {
			break
		}
		if len(got) != 3 {
			t.Fatalf("full page expected before the last one, got %v", got)
		}
		path = "/v2/sandboxes?limit=3&nextToken=" + url.QueryEscape(next)
	}
	if len(all) != 7 {
		t.Fatalf("paged through %v", all)
	}
	// An exact last page carries no token.
	if _, next := ids(t, e, "/v2/sandboxes?limit=7"); next != "" {
		t.Fatalf("X-Next-Token %q on the last page", next)
	}
}

func TestListV2Validation(t *testing.T) {
	e := listEnv(t)
	tests := []struct{ query, msg string }{
		{"?state=sleeping", "state"},
		{"?limit=0", "limit"},
		{"?limit=101", "limit"},
		{"?limit=ten", "limit"},
		{"?order=up", "order"},
		{"?startedAfter=yesterday", "startedAfter"},
		{"?metadata=" + url.QueryEscape("oops"), "key=value"},
	}
	for _, tt := range tests {
		t.Run(tt.query, func(t *testing.T) {
			wantError(t, e.do("GET", "/v2/sandboxes"+tt.query, ""), 400, tt.msg)
		})
	}
}

func TestListV1RunningOnly(t *testing.T) {
	e := listEnv(t)
	got, next := ids(t, e, "/sandboxes")
	if len(got) != 5 || next != "" {
		t.Fatalf("v1 list = %v (next %q), want the 5 running", got, next)
	}
	for _, s := range got {
		if !strings.HasSuffix(s, ":running") {
			t.Fatalf("v1 list includes %s", s)
		}
	}
	got, _ = ids(t, e, "/sandboxes?metadata=user%3Da%252520b")
	if strings.Join(got, " ") != "s2:running" {
		t.Fatalf("v1 metadata filter = %v", got)
	}
}
