package sandbox

import (
	"context"
	"errors"
	"fmt"
	"net/netip"
	"strings"
)

// ErrBadDestination means an egress rule entry is not an IP address or CIDR block.
var ErrBadDestination = errors.New("bad egress destination")

// Egress is a sandbox's outbound policy (E2B's allow_internet_access and network's
// allowOut, denyOut, rules and egressProxy). Evaluation order, as in E2B: a destination
// in AllowOut (by address, or by name for AllowDomains) is reachable, even when it is
// also in DenyOut and even without internet access; otherwise one in DenyOut is not;
// otherwise AllowInternet decides. AllowOut alone restricts nothing.
type Egress struct {
	AllowInternet bool
	AllowOut      []netip.Prefix
	DenyOut       []netip.Prefix
	// AllowDomains are allowOut's domain patterns (ParseDomainPattern), matched against
	// the TLS SNI or HTTP Host of a connection.
	AllowDomains []string
	// Rules are request transforms per domain pattern or IP address (ParseRules).
	Rules map[string][]Transform
	// Proxy tunnels the sandbox's outbound TCP through a SOCKS5 server.
	Proxy *SOCKSProxy
}

// NeedsProxy reports whether the policy needs the node's egress proxy: what nftables
// cannot decide (names, request rewriting, tunnelling).
func (e Egress) NeedsProxy() bool {
	return len(e.AllowDomains) > 0 || len(e.Rules) > 0 || e.Proxy != nil
}

// EgressUpdater is implemented by instances whose outbound policy can be changed while
// they exist (running or paused in place). The orchestrator applies a sandbox's policy
// after every launch and on PUT /sandboxes/{id}/network; backends without it can only
// honour AllowInternet (through LaunchPlan).
type EgressUpdater interface {
	UpdateEgress(ctx context.Context, e Egress) error
}

// ParseDestinations turns E2B egress entries (bare IP addresses or CIDR blocks, IPv4 or
// IPv6) into masked prefixes, in order and without duplicates. field names the list in
// errors. Domain names are refused (E2B takes them in allowOut only: ParseAllowOut).
func ParseDestinations(field string, entries []string) ([]netip.Prefix, error) {
	out := make([]netip.Prefix, 0, len(entries))
	seen := map[netip.Prefix]bool{}
	for _, raw := range entries {
		s := strings.TrimSpace(raw)
		var p netip.Prefix
		var err error
		if strings.Contains(s, "/") {
			p, err = netip.ParsePrefix(s)
		} else {
			var a netip.Addr
			if a, err = netip.ParseAddr(s); err == nil {
				if a.Zone() != "" {
					err = errors.New("zoned address")
				}
				p = netip.PrefixFrom(a, a.BitLen())
			}
		}
		if err != nil {
			if looksLikeDomain(s) {
				return nil, fmt.Errorf("%w: %s entry %q is a domain name; only IP addresses and CIDR blocks are supported in this list", ErrBadDestination, field, raw)
			}
			return nil, fmt.Errorf("%w: %s entry %q is not an IP address or CIDR block", ErrBadDestination, field, raw)
		}
		if p.Addr().Is4In6() && p.Bits() >= 96 {
			p = netip.PrefixFrom(p.Addr().Unmap(), p.Bits()-96)
		}
		p = p.Masked()
		if !seen[p] {
			seen[p] = true
			out = append(out, p)
		}
	}
	return out, nil
}

func looksLikeDomain(s string) bool {
	s = strings.TrimPrefix(s, "*.")
	if s == "" || !strings.Contains(s, ".") {
		return false
	}
	for _, r := range s {
		if !(r >= 'a' && r <= 'z' || r >= 'A' && r <= 'Z' || r >= '0' && r <= '9' || r == '-' || r == '.') {
			return false
		}
	}
	return true
}

// FormatDestinations is the inverse of ParseDestinations (for API responses).
func FormatDestinations(ps []netip.Prefix) []string {
	out := make([]string, len(ps))
	for i, p := range ps {
		out[i] = p.String()
	}
	return out
}
