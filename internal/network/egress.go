package network

import (
	"context"
	"errors"
	"fmt"
	"net/netip"
	"slices"
	"strings"
	"sync"

	"github.com/aenv-dev/aenv/internal/sandbox"
)

// Per-slot egress rules (E2B's network.allowOut / denyOut) are elements of two sets of
// the inet table keyed by (sandbox address . destination interval), matched by two
// static rules of the forward chain around the "blocked" (no internet) rule:
//
//	ip saddr . ip daddr @egress_allow accept   // exceptions win over everything below
//	ip saddr @blocked drop                     // allow_internet_access=false
//	ip saddr . ip daddr @egress_deny drop
//
// so changing a sandbox's policy is one atomic element update, never a rule rewrite,
// and a packet costs two set lookups whatever the number of sandboxes or entries.
// Only IPv4 destinations are installed: sandboxes have no IPv6 route and the forward
// chain drops their IPv6 anyway.

// egressState is what a slot has installed in the egress sets.
type egressState struct {
	mu    sync.Mutex
	allow []netip.Prefix
	deny  []netip.Prefix
	proxy proxyMode
}

// SetEgress replaces the slot's allow and deny destinations atomically. Entries may
// overlap (the kernel refuses overlapping intervals, so nested ones are folded into the
// enclosing one first); IPv6 entries are ignored. It is a no-op when nothing changes.
func (p *Pool) SetEgress(ctx context.Context, s *Slot, allow, deny []netip.Prefix) error {
	allow, deny = foldPrefixes(allow), foldPrefixes(deny)
	s.egress.mu.Lock()
	defer s.egress.mu.Unlock()
	if slices.Equal(allow, s.egress.allow) && slices.Equal(deny, s.egress.deny) {
		return nil
	}
	var b strings.Builder
	p.writeElements(&b, "egress_allow", s, s.egress.allow, allow)
	p.writeElements(&b, "egress_deny", s, s.egress.deny, deny)
	if err := nft(ctx, b.String()); err != nil {
		return fmt.Errorf("network: egress rules for %s: %w", s.IP, err)
	}
	s.egress.allow, s.egress.deny = allow, deny
	return nil
}

// ApplyEgress installs a sandbox's whole egress policy on its slot: the allow and deny
// destinations, the egress proxy (domains, request transforms, a SOCKS5 tunnel), then
// outbound NAT for AllowInternet. Each step is atomic; between them (milliseconds) the
// old internet setting applies with the new destinations.
func (p *Pool) ApplyEgress(ctx context.Context, s *Slot, e sandbox.Egress) error {
	if err := p.SetEgress(ctx, s, e.AllowOut, e.DenyOut); err != nil {
		return err
	}
	if err := p.SetProxied(ctx, s, e); err != nil {
		return err
	}
	return p.SetInternet(ctx, s, e.AllowInternet)
}

// Egress returns the IPv4 destinations installed for the slot (folded).
func (s *Slot) Egress() (allow, deny []netip.Prefix) {
	s.egress.mu.Lock()
	defer s.egress.mu.Unlock()
	return slices.Clone(s.egress.allow), slices.Clone(s.egress.deny)
}

// clearEgress removes the slot's elements, so an address handed out again starts clean.
func (p *Pool) clearEgress(ctx context.Context, s *Slot) error {
	return errors.Join(p.SetProxied(ctx, s, sandbox.Egress{}), p.SetEgress(ctx, s, nil, nil))
}

// writeElements writes the nft commands that turn the slot's elements of set from old
// into new. Old elements are added back before they are deleted so the transaction does
// not fail if the table was re-created meanwhile ("destroy" needs nft >= 1.0.8).
func (p *Pool) writeElements(b *strings.Builder, set string, s *Slot, old, new []netip.Prefix) {
	if slices.Equal(old, new) {
		return
	}
	if len(old) > 0 {
		elems := elements(s.IP, old)
		fmt.Fprintf(b, "add element inet %s %s { %s }\n", p.cfg.Bridge, set, elems)
		fmt.Fprintf(b, "delete element inet %s %s { %s }\n", p.cfg.Bridge, set, elems)
	}
	if len(new) > 0 {
		fmt.Fprintf(b, "add element inet %s %s { %s }\n", p.cfg.Bridge, set, elements(s.IP, new))
	}
}

func elements(src netip.Addr, dst []netip.Prefix) string {
	parts := make([]string, len(dst))
	for i, d := range dst {
		parts[i] = src.String() + " . " + d.String()
	}
	return strings.Join(parts, ", ")
}

// foldPrefixes keeps the IPv4 prefixes of in that no other one contains, sorted, so
// the result is a set of disjoint intervals.
func foldPrefixes(in []netip.Prefix) []netip.Prefix {
	v4 := make([]netip.Prefix, 0, len(in))
	for _, q := range in {
		if q.IsValid() && q.Addr().Is4() {
			v4 = append(v4, q.Masked())
		}
	}
	// Shortest first: a prefix can only be contained in one at least as short.
	slices.SortFunc(v4, func(a, b netip.Prefix) int {
		if a.Bits() != b.Bits() {
			return a.Bits() - b.Bits()
		}
		return a.Addr().Compare(b.Addr())
	})
	var out []netip.Prefix
	for _, q := range v4 {
		covered := false
		for _, k := range out {
			if k.Contains(q.Addr()) {
				covered = true
				break
			}
		}
		if !covered {
			out = append(out, q)
		}
	}
	slices.SortFunc(out, func(a, b netip.Prefix) int { return a.Addr().Compare(b.Addr()) })
	return out
}
