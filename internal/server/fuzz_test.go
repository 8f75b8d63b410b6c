package server

import (
	"maps"
	"net/url"
	"strings"
	"testing"
)

// FuzzDecodeMetadataFilter: any key/value pair encoded the way the JS SDK does (each part
// escaped, then the query string escaped again) decodes back to itself; arbitrary input
// never panics.
func FuzzDecodeMetadataFilter(f *testing.F) {
	f.Add("user", "a b", "user%3Da%2520b")
	f.Add("k&=", "v=&%", "a=1&b=2")
	f.Add("ключ", "значение", "%zz")
	f.Fuzz(func(t *testing.T, k, v, raw string) {
		_, _ = decodeMetadataFilter(raw)
		if k == "" {
			return
		}
		enc := url.QueryEscape(url.QueryEscape(k)) + "=" + url.QueryEscape(url.QueryEscape(v))
		got, err := decodeMetadataFilter(enc)
		if err != nil {
			t.Fatalf("decode(%q) for %q=%q: %v", enc, k, v, err)
		}
		if want := map[string]string{k: v}; !maps.Equal(got, want) {
			t.Fatalf("decode(%q) = %v, want %v", enc, got, want)
		}
	})
}

// FuzzHostTarget: host parsing never panics and only yields valid ports and ids.
func FuzzHostTarget(f *testing.F) {
	s := &Server{domains: normalizeDomains([]string{"sbx.test", "localhost:8000"})}
	f.Add("49983-abc.sbx.test")
	f.Add("8080-a-b-c.localhost:8000")
	f.Add("-x.sbx.test")
	f.Add("99999999999999999999-x.sbx.test:1")
	f.Fuzz(func(t *testing.T, host string) {
		id, port, ok := s.hostTarget(host)
		if !ok {
			return
		}
		if port < 1 || port > 65535 || id == "" || strings.Contains(id, ".") {
			t.Fatalf("hostTarget(%q) = %q, %d", host, id, port)
		}
	})
}
