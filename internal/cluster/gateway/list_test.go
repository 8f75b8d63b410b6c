package gateway

import (
	"encoding/base64"
	"slices"
	"testing"
	"time"
)

func items(at map[string]int) []listed {
	var out []listed
	for id, sec := range at {
		out = append(out, listed{id: id, at: time.Unix(int64(sec), 0)})
	}
	// A node answers in its order (newest first); merge must not rely on it.
	return out
}

func ids(ls []listed) []string {
	out := make([]string, len(ls))
	for i, l := range ls {
		out[i] = l.id
	}
	return out
}

func TestMerge(t *testing.T) {
	for _, tc := range []struct {
		name     string
		pages    []page
		limit    int
		asc      bool
		paged    bool
		want     []string
		wantMore bool
	}{
		{"newest first across nodes", []page{{items: items(map[string]int{"a": 1, "c": 3})}, {items: items(map[string]int{"b": 2})}},
			10, false, true, []string{"c", "b", "a"}, false},
		{"ascending", []page{{items: items(map[string]int{"a": 1, "c": 3})}, {items: items(map[string]int{"b": 2})}},
			10, true, true, []string{"a", "b", "c"}, false},
		{"cut at limit", []page{{items: items(map[string]int{"a": 1, "c": 3})}, {items: items(map[string]int{"b": 2, "d": 4})}},
			3, false, true, []string{"d", "c", "b"}, true},
		{"a node has more", []page{{items: items(map[string]int{"a": 1}), more: true}, {items: items(map[string]int{"b": 2})}},
			2, false, true, []string{"b", "a"}, true},
		{"same time: by id", []page{{items: items(map[string]int{"x": 5})}, {items: items(map[string]int{"y": 5})}},
			10, false, true, []string{"y", "x"}, false},
		{"duplicates once", []page{{items: items(map[string]int{"s1": 5, "s2": 6})}, {items: items(map[string]int{"s1": 5})}},
			10, false, true, []string{"s2", "s1"}, false},
		{"unpaged keeps all", []page{{items: items(map[string]int{"a": 1, "b": 2}), more: true}},
			1, false, false, []string{"b", "a"}, false},
		{"no nodes", nil, 10, false, true, []string{}, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			got, more := merge(tc.pages, tc.limit, tc.asc, tc.paged)
			if !slices.Equal(ids(got), tc.want) || more != tc.wantMore {
				t.Fatalf("merge = %v, more %v; want %v, more %v", ids(got), more, tc.want, tc.wantMore)
			}
		})
	}
}

// The cursor must be the nodes' own token format, or the next page starts elsewhere.
func TestEncodeCursorMatchesNodes(t *testing.T) {
	at := time.Date(2026, 1, 2, 3, 4, 5, 600, time.FixedZone("x", 3600))
	raw, err := base64.RawURLEncoding.DecodeString(encodeCursor(at, "sb-1"))
	if err != nil || string(raw) != "2026-01-02T02:04:05.0000006Z__sb-1" {
		t.Fatalf("cursor %q, %v", raw, err)
	}
}

func TestSandboxOfPath(t *testing.T) {
	for p, want := range map[string]string{
		"/sandboxes/abc": "abc", "/sandboxes/abc/pause": "abc", "/v2/sandboxes/abc/connect": "abc",
		"/sandboxes": "", "/sandboxes/": "", "/v2/sandboxes": "", "/templates/abc": "",
	} {
		if got, ok := sandboxOfPath(p); got != want || ok != (want != "") {
			t.Errorf("sandboxOfPath(%q) = %q, %v; want %q", p, got, ok, want)
		}
	}
}
