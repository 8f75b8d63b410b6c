package network

import (
	"fmt"
	"net/netip"
	"strings"
)

// DefaultDenyRanges are the infrastructure ranges no sandbox reaches unless the node's
// config allows a range (Config.AllowRanges), as on E2B: link-local (cloud metadata at
// 169.254.169.254), private networks (RFC 1918), carrier-grade NAT (RFC 6598), loopback,
// "this network", IETF protocol assignments, benchmarking, multicast and the reserved
// block. The host's own addresses are refused whatever their range (the input chain), and
// IPv6 (ULA fc00::/7, link-local fe80::/10 and everything else) is never forwarded:
// sandboxes have no IPv6 route. Public internet stays reachable.
var DefaultDenyRanges = []netip.Prefix{
	netip.MustParsePrefix("0.0.0.0/8"),
	netip.MustParsePrefix("10.0.0.0/8"),
	netip.MustParsePrefix("100.64.0.0/10"),
	netip.MustParsePrefix("127.0.0.0/8"),
	netip.MustParsePrefix("169.254.0.0/16"),
	netip.MustParsePrefix("172.16.0.0/12"),
	netip.MustParsePrefix("192.0.0.0/24"),
	netip.MustParsePrefix("192.168.0.0/16"),
	netip.MustParsePrefix("198.18.0.0/15"),
	netip.MustParsePrefix("224.0.0.0/4"),
	netip.MustParsePrefix("240.0.0.0/4"),
}

// checkInfra validates the configured exceptions: IPv4 only (sandboxes have no IPv6).
func (c *Config) checkInfra() error {
	for _, p := range c.AllowRanges {
		if !p.IsValid() || !p.Addr().Is4() {
			return fmt.Errorf("network: allowed range %v is not an IPv4 prefix (sandboxes have no IPv6 route)", p)
		}
	}
	for _, a := range c.DNS {
		if !a.Is4() {
			return fmt.Errorf("network: DNS server %v is not an IPv4 address (sandboxes have no IPv6 route)", a)
		}
	}
	return nil
}

// infraRules are the nftables set and chain of the infrastructure deny: a forward rule
// jumps to chain infra for destinations in the denied ranges, which returns (goes on with
// the sandbox's own rules) for the configured exceptions and DNS on port 53, and drops
// the rest. It runs before allowOut, so a sandbox's own rules cannot open these ranges.
func (p *Pool) infraRules() string {
	var b strings.Builder
	set := func(name string, elems []string) {
		fmt.Fprintf(&b, "\tset %s { type ipv4_addr; flags interval;", name)
		if len(elems) > 0 {
			fmt.Fprintf(&b, " elements = { %s };", strings.Join(elems, ", "))
		}
		b.WriteString(" }\n")
	}
	set("infra_deny", prefixStrings(DefaultDenyRanges))
	set("infra_allow", prefixStrings(p.cfg.AllowRanges))
	dns := make([]string, len(p.cfg.DNS))
	for i, a := range p.cfg.DNS {
		dns[i] = a.String()
	}
	set("infra_dns", dns)
	b.WriteString(`	chain infra {
		ip daddr @infra_allow return
		ip daddr @infra_dns meta l4proto { tcp, udp } th dport 53 return
		drop
	}
`)
	return b.String()
}

func prefixStrings(ps []netip.Prefix) []string {
	out := make([]string, len(ps))
	for i, p := range ps {
		out[i] = p.Masked().String()
	}
	return out
}
