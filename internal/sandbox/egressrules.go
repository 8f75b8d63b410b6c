package sandbox

import (
	"errors"
	"fmt"
	"net"
	"net/netip"
	"sort"
	"strconv"
	"strings"

	"golang.org/x/net/http/httpguts"
)

// Limits on network.rules, so one sandbox's policy stays small in memory and in its record.
const (
	maxRuleDomains    = 256
	maxRulesPerDomain = 16
	maxHeaders        = 64
	maxHeaderValue    = 8 << 10
	maxSOCKSField     = 255
)

// Transform is one E2B network rule's transform: headers set on matching requests
// (replacing a header of the same name).
type Transform struct {
	Headers map[string]string `json:"headers,omitempty"`
}

// SOCKSProxy is network.egressProxy: a SOCKS5 server the sandbox's outbound TCP is
// tunnelled through.
type SOCKSProxy struct {
	Address  string `json:"address"`
	Username string `json:"username,omitempty"`
	Password string `json:"password,omitempty"`
}

// ParseDomainPattern validates an E2B domain pattern: an exact DNS name ("api.example.com")
// or a leading wildcard ("*.example.com", matching subdomains at any depth but not the
// apex). It returns the pattern lowercased without a trailing dot. A bare "*", wildcards
// elsewhere than the first label, IP addresses and single-label names are refused.
func ParseDomainPattern(s string) (string, error) {
	p := strings.TrimSuffix(strings.ToLower(strings.TrimSpace(s)), ".")
	name, wild := strings.CutPrefix(p, "*.")
	if p == "*" || name == "" {
		return "", errors.New("a bare wildcard is not a domain pattern (use 0.0.0.0/0 for all traffic)")
	}
	if _, err := netip.ParseAddr(name); err == nil {
		return "", errors.New("an IP address is not a domain pattern")
	}
	if len(name) > 253 {
		return "", errors.New("longer than 253 characters")
	}
	labels := strings.Split(name, ".")
	if len(labels) < 2 && !wild {
		return "", errors.New("a single-label name is not a domain pattern")
	}
	for _, l := range labels {
		if !validLabel(l) {
			return "", fmt.Errorf("label %q is not a DNS label (1-63 of a-z, 0-9, '-', not at either end; '*' only as the whole first label)", l)
		}
	}
	if _, err := strconv.Atoi(labels[len(labels)-1]); err == nil {
		return "", errors.New("the top-level label is numeric")
	}
	return p, nil
}

func validLabel(l string) bool {
	if l == "" || len(l) > 63 || l[0] == '-' || l[len(l)-1] == '-' {
		return false
	}
	for i := 0; i < len(l); i++ {
		c := l[i]
		if !(c >= 'a' && c <= 'z' || c >= '0' && c <= '9' || c == '-' || c == '_') {
			return false
		}
	}
	return true
}

// MatchDomain reports whether host (lowercase, no trailing dot) matches a pattern from
// ParseDomainPattern.
func MatchDomain(pattern, host string) bool {
	if suffix, ok := strings.CutPrefix(pattern, "*"); ok {
		return len(host) > len(suffix) && strings.HasSuffix(host, suffix)
	}
	return host == pattern
}

// CanonicalHost lowercases a host name from an SNI or a Host header and strips its port
// and trailing dot.
func CanonicalHost(h string) string {
	if host, _, err := net.SplitHostPort(h); err == nil {
		h = host
	}
	h = strings.TrimSuffix(strings.TrimPrefix(strings.TrimSuffix(h, "]"), "["), ".")
	return strings.ToLower(h)
}

// ParseAllowOut splits E2B allowOut entries into IP destinations (ParseDestinations) and
// domain patterns (ParseDomainPattern, deduplicated, in order). field names the list in
// errors.
func ParseAllowOut(field string, entries []string) ([]netip.Prefix, []string, error) {
	var ips, domains []string
	seen := map[string]bool{}
	for _, raw := range entries {
		s := strings.TrimSpace(raw)
		if looksLikeIP(s) {
			ips = append(ips, s)
			continue
		}
		d, err := ParseDomainPattern(s)
		if err != nil {
			return nil, nil, fmt.Errorf("%w: %s entry %q is neither an IP address, a CIDR block nor a domain pattern: %v", ErrBadDestination, field, raw, err)
		}
		if !seen[d] {
			seen[d] = true
			domains = append(domains, d)
		}
	}
	prefixes, err := ParseDestinations(field, ips)
	if err != nil {
		return nil, nil, err
	}
	return prefixes, domains, nil
}

// looksLikeIP is true for entries that can only be meant as an address or a block: they
// are parsed as such, and refused as such when malformed.
func looksLikeIP(s string) bool {
	if strings.ContainsAny(s, ":/") {
		return true
	}
	for _, r := range s {
		if !(r >= '0' && r <= '9' || r == '.') {
			return false
		}
	}
	return s != ""
}

// ParseRules validates network.rules (keys: domain patterns or IP addresses; values: the
// rules applied, in order, to requests for a matching host) and returns them with
// canonical keys. Header names must be HTTP tokens other than the ones that frame the
// request, values must be valid header values.
func ParseRules(rules map[string][]Transform) (map[string][]Transform, error) {
	if len(rules) == 0 {
		return nil, nil
	}
	if len(rules) > maxRuleDomains {
		return nil, fmt.Errorf("%w: network.rules has %d domains, at most %d", ErrBadDestination, len(rules), maxRuleDomains)
	}
	out := make(map[string][]Transform, len(rules))
	for key, list := range rules {
		k, err := ruleKey(key)
		if err != nil {
			return nil, fmt.Errorf("%w: network.rules key %q: %v", ErrBadDestination, key, err)
		}
		if _, dup := out[k]; dup {
			return nil, fmt.Errorf("%w: network.rules key %q appears twice (keys are case-insensitive)", ErrBadDestination, key)
		}
		if len(list) > maxRulesPerDomain {
			return nil, fmt.Errorf("%w: network.rules[%q] has %d rules, at most %d", ErrBadDestination, key, len(list), maxRulesPerDomain)
		}
		canon := make([]Transform, len(list))
		for i, tr := range list {
			if err := checkHeaders(tr.Headers); err != nil {
				return nil, fmt.Errorf("%w: network.rules[%q][%d].transform.headers: %v", ErrBadDestination, key, i, err)
			}
			if len(tr.Headers) > 0 {
				canon[i].Headers = make(map[string]string, len(tr.Headers))
				for n, v := range tr.Headers {
					canon[i].Headers[n] = v
				}
			}
		}
		out[k] = canon
	}
	return out, nil
}

func ruleKey(key string) (string, error) {
	s := strings.TrimSpace(key)
	if a, err := netip.ParseAddr(s); err == nil && a.Zone() == "" {
		return a.Unmap().String(), nil
	}
	return ParseDomainPattern(s)
}

// framingHeaders may not be set by a transform: they decide where a request ends or
// which server it is for, not what it says.
var framingHeaders = map[string]bool{
	"host": true, "content-length": true, "transfer-encoding": true, "connection": true,
	"upgrade": true, "te": true, "trailer": true, "keep-alive": true, "proxy-connection": true,
}

func checkHeaders(h map[string]string) error {
	if len(h) > maxHeaders {
		return fmt.Errorf("%d headers, at most %d", len(h), maxHeaders)
	}
	for n, v := range h {
		if !httpguts.ValidHeaderFieldName(n) {
			return fmt.Errorf("%q is not a valid header name", n)
		}
		if framingHeaders[strings.ToLower(n)] {
			return fmt.Errorf("header %q cannot be set by a transform", n)
		}
		if len(v) > maxHeaderValue || !httpguts.ValidHeaderFieldValue(v) {
			return fmt.Errorf("the value of %q is not a valid header value (at most %d bytes, no control characters)", n, maxHeaderValue)
		}
	}
	return nil
}

// LookupRules returns the rules for host: an exact key first, else the longest matching
// wildcard; rule sets are never merged (E2B's precedence).
func LookupRules(rules map[string][]Transform, host string) ([]Transform, bool) {
	if r, ok := rules[host]; ok {
		return r, true
	}
	best := ""
	for k := range rules {
		if strings.HasPrefix(k, "*.") && MatchDomain(k, host) && len(k) > len(best) {
			best = k
		}
	}
	if best == "" {
		return nil, false
	}
	return rules[best], true
}

// RuleKeys returns the keys of rules, sorted (for stable records and logs).
func RuleKeys(rules map[string][]Transform) []string {
	keys := make([]string, 0, len(rules))
	for k := range rules {
		keys = append(keys, k)
	}
	sort.Strings(keys)
	return keys
}

// ParseSOCKSProxy validates network.egressProxy: a host:port address (host a DNS name or
// an IP literal, port 1-65535) and RFC 1929 credentials of at most 255 bytes each, a
// password only with a username. nil stays nil.
func ParseSOCKSProxy(p *SOCKSProxy) (*SOCKSProxy, error) {
	if p == nil {
		return nil, nil
	}
	host, port, err := net.SplitHostPort(strings.TrimSpace(p.Address))
	if err != nil {
		return nil, fmt.Errorf("%w: network.egressProxy.address %q is not host:port: %v", ErrBadDestination, p.Address, err)
	}
	if n, err := strconv.Atoi(port); err != nil || n < 1 || n > 65535 {
		return nil, fmt.Errorf("%w: network.egressProxy.address %q: port must be 1-65535", ErrBadDestination, p.Address)
	}
	if a, err := netip.ParseAddr(host); err == nil {
		if a.Zone() != "" {
			return nil, fmt.Errorf("%w: network.egressProxy.address %q: zoned addresses are not supported", ErrBadDestination, p.Address)
		}
	} else if _, err := ParseDomainPattern(host); err != nil || strings.HasPrefix(host, "*") {
		return nil, fmt.Errorf("%w: network.egressProxy.address %q: host is neither an IP address nor a DNS name", ErrBadDestination, p.Address)
	}
	if len(p.Username) > maxSOCKSField || len(p.Password) > maxSOCKSField {
		return nil, fmt.Errorf("%w: network.egressProxy username and password are at most %d bytes each", ErrBadDestination, maxSOCKSField)
	}
	if p.Password != "" && p.Username == "" {
		return nil, fmt.Errorf("%w: network.egressProxy.password needs a username", ErrBadDestination)
	}
	return &SOCKSProxy{Address: net.JoinHostPort(strings.ToLower(host), port), Username: p.Username, Password: p.Password}, nil
}
