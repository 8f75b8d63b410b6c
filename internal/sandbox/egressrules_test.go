package sandbox

import (
	"errors"
	"fmt"
	"strings"
	"testing"
)

func TestParseDomainPattern(t *testing.T) {
	tests := []struct{ in, want, err string }{
		{in: "Example.COM.", want: "example.com"},
		{in: " *.example.com ", want: "*.example.com"},
		{in: "*.com", want: "*.com"},
		{in: "a-b.x_y.example.org", want: "a-b.x_y.example.org"},
		{in: "*", err: "bare wildcard"},
		{in: "*.", err: "bare wildcard"},
		{in: "a.*.example.com", err: "not a DNS label"},
		{in: "*example.com", err: "not a DNS label"},
		{in: "**.example.com", err: "not a DNS label"},
		{in: "-a.example.com", err: "not a DNS label"},
		{in: "a..example.com", err: "not a DNS label"},
		{in: "exa mple.com", err: "not a DNS label"},
		{in: strings.Repeat("a", 64) + ".com", err: "not a DNS label"},
		{in: strings.Repeat("a.", 127) + "com", err: "longer than 253"},
		{in: "localhost", err: "single-label"},
		{in: "1.2.3.4", err: "IP address"},
		{in: "1.2.3", err: "numeric"},
	}
	for _, tc := range tests {
		t.Run(tc.in, func(t *testing.T) {
			got, err := ParseDomainPattern(tc.in)
			if tc.err != "" {
				if err == nil || !strings.Contains(err.Error(), tc.err) {
					t.Fatalf("ParseDomainPattern(%q) = %q, %v; want error %q", tc.in, got, err, tc.err)
				}
				return
			}
			if err != nil || got != tc.want {
				t.Fatalf("ParseDomainPattern(%q) = %q, %v; want %q", tc.in, got, err, tc.want)
			}
		})
	}
}

func TestMatchDomain(t *testing.T) {
	tests := []struct {
		pattern, host string
		want          bool
	}{
		{"example.com", "example.com", true},
		{"example.com", "www.example.com", false},
		{"*.example.com", "www.example.com", true},
		{"*.example.com", "a.b.example.com", true},
		{"*.example.com", "example.com", false},
		{"*.example.com", "badexample.com", false},
		{"*.com", "example.com", true},
	}
	for _, tc := range tests {
		if got := MatchDomain(tc.pattern, tc.host); got != tc.want {
			t.Errorf("MatchDomain(%q, %q) = %v, want %v", tc.pattern, tc.host, got, tc.want)
		}
	}
	for in, want := range map[string]string{"API.Example.com:443": "api.example.com", "example.com.": "example.com", "[::1]:80": "::1", "1.2.3.4": "1.2.3.4"} {
		if got := CanonicalHost(in); got != want {
			t.Errorf("CanonicalHost(%q) = %q, want %q", in, got, want)
		}
	}
}

func TestParseAllowOut(t *testing.T) {
	ps, ds, err := ParseAllowOut("allowOut", []string{"1.2.3.4", "*.Example.com", "10.0.0.0/8", "example.com", "*.example.com"})
	if err != nil || fmt.Sprint(FormatDestinations(ps)) != "[1.2.3.4/32 10.0.0.0/8]" || fmt.Sprint(ds) != "[*.example.com example.com]" {
		t.Fatalf("ParseAllowOut = %v %v %v", ps, ds, err)
	}
	for _, bad := range []string{"1.2.3.4/33", "1.2.3.400", "*", "not a name", ""} {
		if _, _, err := ParseAllowOut("allowOut", []string{bad}); !errors.Is(err, ErrBadDestination) || !strings.Contains(err.Error(), "allowOut") {
			t.Errorf("ParseAllowOut(%q) err = %v", bad, err)
		}
	}
}

func TestRules(t *testing.T) {
	h := func(kv ...string) []Transform { return []Transform{{Headers: map[string]string{kv[0]: kv[1]}}} }
	rules, err := ParseRules(map[string][]Transform{
		"API.example.com": h("Authorization", "a"), "*.example.com": h("X", "w"),
		"*.b.example.com": h("X", "b"), "10.0.0.1": h("X", "ip"),
	})
	if err != nil {
		t.Fatal(err)
	}
	for host, want := range map[string]string{
		"api.example.com": "Authorization=a", "x.example.com": "X=w", "a.b.example.com": "X=b",
		"b.example.com": "X=w", "10.0.0.1": "X=ip", "example.com": "", "other.org": "",
	} {
		got := ""
		if r, ok := LookupRules(rules, host); ok {
			for k, v := range r[0].Headers {
				got = k + "=" + v
			}
		}
		if got != want {
			t.Errorf("LookupRules(%q) = %q, want %q", host, got, want)
		}
	}
	bad := []struct {
		rules map[string][]Transform
		err   string
	}{
		{map[string][]Transform{"*": nil}, "bare wildcard"},
		{map[string][]Transform{"a.com": nil, "A.com": nil}, "appears twice"},
		{map[string][]Transform{"a.com": h("Bad Name", "x")}, "not a valid header name"},
		{map[string][]Transform{"a.com": h("Host", "x")}, "cannot be set"},
		{map[string][]Transform{"a.com": h("X", "a\nb")}, "not a valid header value"},
		{map[string][]Transform{"a.com": make([]Transform, maxRulesPerDomain+1)}, "at most"},
	}
	for _, tc := range bad {
		if _, err := ParseRules(tc.rules); !errors.Is(err, ErrBadDestination) || !strings.Contains(err.Error(), tc.err) {
			t.Errorf("ParseRules(%v) err = %v, want %q", tc.rules, err, tc.err)
		}
	}
}

func TestParseSOCKSProxy(t *testing.T) {
	p, err := ParseSOCKSProxy(&SOCKSProxy{Address: " Proxy.Example.com:1080", Username: "u", Password: "p"})
	if err != nil || p.Address != "proxy.example.com:1080" || p.Username != "u" || p.Password != "p" {
		t.Fatalf("ParseSOCKSProxy = %+v, %v", p, err)
	}
	if p, err := ParseSOCKSProxy(nil); p != nil || err != nil {
		t.Fatalf("nil = %v %v", p, err)
	}
	for _, bad := range []SOCKSProxy{
		{Address: "proxy.example.com"}, {Address: "proxy.example.com:0"}, {Address: "proxy.example.com:99999"},
		{Address: "*.example.com:1080"}, {Address: "bad host:1080"}, {Address: "1.2.3.4:1080", Password: "p"},
		{Address: "1.2.3.4:1080", Username: strings.Repeat("u", 256)},
	} {
		if _, err := ParseSOCKSProxy(&bad); !errors.Is(err, ErrBadDestination) {
			t.Errorf("ParseSOCKSProxy(%+v) err = %v", bad, err)
		}
	}
}
