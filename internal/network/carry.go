package network

import (
	"context"
	"encoding/json"
	"fmt"
	"net/netip"
	"slices"
	"strings"

	"github.com/vishvananda/netlink"
)

// A start that replaces the tables (tables.go: they are not what it would install, or
// the egress proxy's port changed) empties their sets. The sandboxes a restart adopts would then run
// without their internet block, their deny destinations and their proxy redirect until
// their backend re-applies them: a window in which a sandbox cut off from the internet is
// not. So the start reads the elements the surviving slots hold and puts them back in the
// transaction that replaces the tables; Reconcile then removes those of the slots it does
// not keep and seeds the kept slots' state with them, so re-applying an unchanged policy
// costs no nft run.

// carriedSlot is what one surviving slot held in the sets.
type carriedSlot struct {
	blocked     bool
	allow, deny []netip.Prefix
	proxy       proxyMode
}

// nftObject is the part of one object of `nft -j list table` that a start reads: a set's
// name and elements (carried here), a rule's comment (the fingerprint, tables.go). The
// listing is decoded once for both.
type nftObject struct {
	Set *struct {
		Name string            `json:"name"`
		Elem []json.RawMessage `json:"elem"`
	} `json:"set"`
	Rule *struct {
		Comment string `json:"comment"`
	} `json:"rule"`
}

// decodeListing decodes the output of `nft -j list table`.
func decodeListing(out []byte) ([]nftObject, error) {
	var doc struct {
		Nftables []nftObject `json:"nftables"`
	}
	if err := json.Unmarshal(out, &doc); err != nil {
		return nil, fmt.Errorf("network: parse nft's listing: %w", err)
	}
	return doc.Nftables, nil
}

// openTables lists the tables an earlier run left, starts the egress proxy (on the port
// they name when it is free) and installs the rules, unless the installed tables are
// already these rules (tables.go): then they stay, and the set elements of every source
// are carried (Reconcile removes those of slots it does not keep). Replaced tables get
// back the elements whose source is one of ips (the slots an earlier run left).
func (p *Pool) openTables(ctx context.Context, ips map[netip.Addr]bool, links []netlink.Link) (map[netip.Addr]*carriedSlot, bool, error) {
	inet, bridge, err := p.listTables(ctx)
	if err != nil {
		// Still start: the backends re-apply every adopted sandbox's policy, only later.
		p.cfg.Logger.Warn("network: the surviving sandboxes' egress rules are not carried over; they are re-applied when adopted", "err", err)
		inet, bridge = installed{}, installed{}
	}
	if err := p.startEgressProxy(fingerprintPort(inet.comment)); err != nil {
		return nil, false, err
	}
	inetText, bridgeText := p.tables(links)
	keep := tablesMatch(inet, bridge, inetText, bridgeText)
	var carried map[netip.Addr]*carriedSlot
	if inet.raw != nil {
		only := ips
		if keep {
			only = nil
		}
		if carried, err = carriedIn(inet.objs, only); err != nil {
			p.cfg.Logger.Warn("network: the surviving sandboxes' egress rules are not carried over; they are re-applied when adopted", "err", err)
			carried, keep = nil, false
		}
	}
	if err := p.installRules(ctx, inetText, bridgeText, carried, keep); err != nil {
		p.stopEgressProxy()
		return nil, false, err
	}
	return carried, keep, nil
}

// parseCarried reads the set elements of the output of `nft -j list table inet <bridge>`
// whose source is one of ips (nil: every source).
func parseCarried(out []byte, ips map[netip.Addr]bool) (map[netip.Addr]*carriedSlot, error) {
	objs, err := decodeListing(out)
	if err != nil {
		return nil, err
	}
	return carriedIn(objs, ips)
}

// carriedIn is parseCarried of a decoded listing.
func carriedIn(objs []nftObject, ips map[netip.Addr]bool) (map[netip.Addr]*carriedSlot, error) {
	carried := map[netip.Addr]*carriedSlot{}
	slot := func(a netip.Addr) *carriedSlot {
		if carried[a] == nil {
			carried[a] = &carriedSlot{}
		}
		return carried[a]
	}
	for _, obj := range objs {
		if obj.Set == nil {
			continue
		}
		name := obj.Set.Name
		switch name {
		case "blocked", "egress_proxy_web", "egress_proxy_all", "egress_allow", "egress_deny":
		default:
			continue // the rules' own sets (bridges, infrastructure ranges) are rebuilt
		}
		for _, raw := range obj.Set.Elem {
			src, dst, err := parseElem(raw)
			if err != nil {
				return nil, fmt.Errorf("network: set %s: %w", name, err)
			}
			if ips != nil && !ips[src] {
				continue
			}
			switch name {
			case "blocked":
				slot(src).blocked = true
			case "egress_proxy_web":
				slot(src).proxy = proxyWeb
			case "egress_proxy_all":
				slot(src).proxy = proxyAll
			case "egress_allow":
				slot(src).allow = append(slot(src).allow, dst)
			case "egress_deny":
				slot(src).deny = append(slot(src).deny, dst)
			}
		}
	}
	for _, c := range carried {
		// The order SetEgress keeps, so an unchanged policy compares equal.
		c.allow, c.deny = foldPrefixes(c.allow), foldPrefixes(c.deny)
	}
	return carried, nil
}

// parseElem reads one element: an address, or "address . destination" where the
// destination is an address or a prefix.
func parseElem(raw json.RawMessage) (src netip.Addr, dst netip.Prefix, err error) {
	var a string
	if json.Unmarshal(raw, &a) == nil {
		src, err = netip.ParseAddr(a)
		return src, dst, err
	}
	var c struct {
		Concat []json.RawMessage `json:"concat"`
	}
	if err := json.Unmarshal(raw, &c); err != nil || len(c.Concat) != 2 {
		return src, dst, fmt.Errorf("element %s is neither an address nor a pair", raw)
	}
	if err := json.Unmarshal(c.Concat[0], &a); err != nil {
		return src, dst, fmt.Errorf("element %s: source is not an address", raw)
	}
	if src, err = netip.ParseAddr(a); err != nil {
		return src, dst, err
	}
	if json.Unmarshal(c.Concat[1], &a) == nil {
		d, err := netip.ParseAddr(a)
		if err != nil {
			return src, dst, err
		}
		return src, netip.PrefixFrom(d, d.BitLen()), nil
	}
	var pr struct {
		Prefix struct {
			Addr string `json:"addr"`
			Len  int    `json:"len"`
		} `json:"prefix"`
	}
	if err := json.Unmarshal(c.Concat[1], &pr); err != nil || pr.Prefix.Addr == "" {
		// A range: SetEgress only installs prefixes.
		return src, dst, fmt.Errorf("element %s: destination is not a prefix", raw)
	}
	d, err := netip.ParseAddr(pr.Prefix.Addr)
	if err != nil {
		return src, dst, err
	}
	return src, netip.PrefixFrom(d, pr.Prefix.Len), nil
}

// carriedScript adds the carried elements back (inside the transaction that re-creates
// the table).
func (p *Pool) carriedScript(carried map[netip.Addr]*carriedSlot) string {
	var b strings.Builder
	for _, a := range sortedAddrs(carried) {
		p.writeCarried(&b, "add", a, carried[a])
	}
	return b.String()
}

// writeCarried writes op ("add" or "delete") for every element c holds for a.
func (p *Pool) writeCarried(b *strings.Builder, op string, a netip.Addr, c *carriedSlot) {
	if c.blocked {
		fmt.Fprintf(b, "%s element inet %s blocked { %s }\n", op, p.cfg.Bridge, a)
	}
	if c.proxy != proxyNone {
		fmt.Fprintf(b, "%s element inet %s %s { %s }\n", op, p.cfg.Bridge, c.proxy.set(), a)
	}
	if len(c.allow) > 0 {
		fmt.Fprintf(b, "%s element inet %s egress_allow { %s }\n", op, p.cfg.Bridge, elements(a, c.allow))
	}
	if len(c.deny) > 0 {
		fmt.Fprintf(b, "%s element inet %s egress_deny { %s }\n", op, p.cfg.Bridge, elements(a, c.deny))
	}
}

// settleCarried runs after Reconcile has chosen the slots to keep: the elements of
// slots it removed go, a kept slot allowed the internet leaves the blocked set and one
// not allowed it joins it, and every kept slot starts from the destinations and redirect
// it holds. One nft run for all, none when the sets already are as they should.
func (p *Pool) settleCarried(ctx context.Context, carried map[netip.Addr]*carriedSlot, kept map[int]*Slot) error {
	keptBy := map[netip.Addr]*Slot{}
	for _, s := range kept {
		keptBy[s.IP] = s
	}
	var b strings.Builder
	for _, a := range sortedAddrs(carried) {
		c := carried[a]
		s := keptBy[a]
		if s == nil {
			p.writeCarried(&b, "delete", a, c)
			continue
		}
		s.egress.allow, s.egress.deny, s.egress.proxy = c.allow, c.deny, c.proxy
		if c.blocked && s.AllowInternet {
			fmt.Fprintf(&b, "delete element inet %s blocked { %s }\n", p.cfg.Bridge, a)
		}
	}
	var blocked []string
	for _, s := range kept {
		if c := carried[s.IP]; !s.AllowInternet && (c == nil || !c.blocked) {
			blocked = append(blocked, s.IP.String())
		}
	}
	if len(blocked) > 0 {
		slices.Sort(blocked)
		fmt.Fprintf(&b, "add element inet %s blocked { %s }\n", p.cfg.Bridge, strings.Join(blocked, ", "))
	}
	if b.Len() == 0 {
		return nil
	}
	if err := nft(ctx, b.String()); err != nil {
		return fmt.Errorf("network: settle the set elements an earlier run left: %w", err)
	}
	return nil
}

func sortedAddrs(m map[netip.Addr]*carriedSlot) []netip.Addr {
	out := make([]netip.Addr, 0, len(m))
	for a := range m {
		out = append(out, a)
	}
	slices.SortFunc(out, func(x, y netip.Addr) int { return x.Compare(y) })
	return out
}
