package network

import (
	"context"
	"fmt"
	"net"
	"net/netip"
	"time"

	"github.com/aenv-dev/aenv/internal/egressproxy"
	"github.com/aenv-dev/aenv/internal/sandbox"
)

// Sandboxes whose policy needs names, request transforms or a SOCKS5 tunnel
// (sandbox.Egress.NeedsProxy) have their outbound TCP redirected to the node's egress
// proxy (package egressproxy), which listens on the bridge address. Two sets of the
// inet table select them:
//
//	egress_proxy_web: TCP to ports 80 and 443 (where SNI and Host name the server; other
//	                  ports stay with the address rules of the forward chain)
//	egress_proxy_all: all TCP (a SOCKS5 tunnel carries every port), except DNS over TCP
//	                  to the sandboxes' nameservers
//
// Redirected connections never cross the forward chain: the proxy applies the same
// rules (infrastructure ranges, allowOut, denyOut, internet access) itself.

// proxyMode is which redirect set a slot is in.
type proxyMode int

const (
	proxyNone proxyMode = iota
	proxyWeb
	proxyAll
)

func (m proxyMode) set() string {
	if m == proxyAll {
		return "egress_proxy_all"
	}
	return "egress_proxy_web"
}

// startEgressProxy listens on the bridge address and serves the proxy until Close. The
// port is put into the rules: port (the one the installed rules name, tables.go) when
// it is free, so those rules can stay, else an ephemeral one.
func (p *Pool) startEgressProxy(port int) error {
	var l net.Listener
	if port > 0 {
		l, _ = net.Listen("tcp4", netip.AddrPortFrom(p.gateway, uint16(port)).String()) // taken: a new port
	}
	if l == nil {
		var err error
		if l, err = net.Listen("tcp4", netip.AddrPortFrom(p.gateway, 0).String()); err != nil {
			return fmt.Errorf("network: egress proxy listener on %s: %w", p.gateway, err)
		}
	}
	cfg := egressproxy.Config{
		Deny: DefaultDenyRanges, Allow: p.cfg.AllowRanges, Subnet: p.subnet,
		Resolver: resolverFor(p.cfg.DNS), Logger: p.cfg.Logger,
		CA: p.cfg.EgressCA, UpstreamRoots: p.cfg.EgressUpstreamRoots,
	}
	p.proxy = egressproxy.New(cfg)
	p.proxyLn = l
	p.proxyPort = l.Addr().(*net.TCPAddr).Port
	go func() { _ = p.proxy.Serve(l) }()
	return nil
}

// resolverFor resolves with the sandboxes' nameservers, so the proxy and the sandbox see
// the same answers; none configured: the host's resolver.
func resolverFor(dns []netip.Addr) *net.Resolver {
	if len(dns) == 0 {
		return net.DefaultResolver
	}
	return &net.Resolver{PreferGo: true, Dial: func(ctx context.Context, network, _ string) (net.Conn, error) {
		var d net.Dialer
		var err error
		for _, a := range dns {
			var c net.Conn
			if c, err = d.DialContext(ctx, network, netip.AddrPortFrom(a, 53).String()); err == nil {
				return c, nil
			}
		}
		return nil, err
	}}
}

// stopEgressProxy closes the listener and the proxied connections.
func (p *Pool) stopEgressProxy() {
	if p.proxyLn == nil {
		return
	}
	_ = p.proxyLn.Close()
	done := make(chan struct{})
	go func() { p.proxy.Close(); close(done) }()
	select {
	case <-done:
	case <-time.After(5 * time.Second):
	}
}

// SetProxied gives the slot's outbound TCP to the egress proxy under policy e when
// e.NeedsProxy(), or takes it back otherwise. The proxy learns the policy before the
// redirect starts and forgets it after the redirect stopped.
func (p *Pool) SetProxied(ctx context.Context, s *Slot, e sandbox.Egress) error {
	mode := proxyNone
	switch {
	case e.Proxy != nil:
		mode = proxyAll
	case e.NeedsProxy():
		mode = proxyWeb
	}
	if mode != proxyNone && p.proxy == nil {
		return fmt.Errorf("network: %s needs the egress proxy, which is not running", s.IP)
	}
	s.egress.mu.Lock()
	defer s.egress.mu.Unlock()
	if mode != proxyNone {
		p.proxy.Set(s.IP, e)
	}
	if mode != s.egress.proxy {
		var script string
		if s.egress.proxy != proxyNone {
			// Added back first so the delete cannot fail on a re-created table.
			script += fmt.Sprintf("add element inet %[1]s %[2]s { %[3]s }\ndelete element inet %[1]s %[2]s { %[3]s }\n", p.cfg.Bridge, s.egress.proxy.set(), s.IP)
		}
		if mode != proxyNone {
			script += fmt.Sprintf("add element inet %s %s { %s }\n", p.cfg.Bridge, mode.set(), s.IP)
		}
		if err := nft(ctx, script); err != nil {
			if s.egress.proxy == proxyNone && p.proxy != nil {
				p.proxy.Remove(s.IP)
			}
			return fmt.Errorf("network: egress proxy redirect for %s: %w", s.IP, err)
		}
		s.egress.proxy = mode
	}
	if mode == proxyNone && p.proxy != nil {
		p.proxy.Remove(s.IP)
	}
	return nil
}

// proxyRules are the nftables parts of the redirect (inside the inet table). Proxied
// sandboxes also always reach their nameservers (forward): filtering by name is
// useless if "denyOut: 0.0.0.0/0" stops the sandbox from resolving the names it may use.
func (p *Pool) proxyRules() (sets, prerouting, input, forward string) {
	sets = "\tset egress_proxy_web { type ipv4_addr; }\n\tset egress_proxy_all { type ipv4_addr; }\n"
	if p.proxyPort == 0 {
		return sets, "", "", ""
	}
	prerouting = fmt.Sprintf(`	chain prerouting {
		type nat hook prerouting priority dstnat; policy accept;
		iifname @bridges ip saddr @egress_proxy_all ip daddr @infra_dns tcp dport 53 accept
		iifname @bridges ip saddr @egress_proxy_all meta l4proto tcp redirect to :%[1]d
		iifname @bridges ip saddr @egress_proxy_web tcp dport { 80, 443 } redirect to :%[1]d
	}
`, p.proxyPort)
	input = fmt.Sprintf("\t\tiifname @bridges ip daddr %s tcp dport %d ct status dnat accept\n", p.gateway, p.proxyPort)
	for _, set := range []string{"egress_proxy_web", "egress_proxy_all"} {
		forward += fmt.Sprintf("\t\tiifname @bridges ip saddr @%s ip daddr @infra_dns meta l4proto { tcp, udp } th dport 53 accept\n", set)
	}
	return sets, prerouting, input, forward
}
