package network

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net/netip"
	"os/exec"
	"slices"
	"strings"
)

// A start replaces the tables (the redirect rule names the egress proxy's port, new with
// every start), which empties their sets. The sandboxes a restart adopts would then run
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

// nftSetJSON is the part of `nft -j list table` this reads.
type nftSetJSON struct {
	Set *struct {
		Name string            `json:"name"`
		Elem []json.RawMessage `json:"elem"`
	} `json:"set"`
}

// readCarried returns the set elements of the existing inet table whose source is one of
// ips (the slots an earlier run left), by source. No table: nothing.
func (p *Pool) readCarried(ctx context.Context, ips map[netip.Addr]bool) (map[netip.Addr]*carriedSlot, error) {
	out, err := exec.CommandContext(ctx, "nft", "-j", "list", "table", "inet", p.cfg.Bridge).Output()
	if err != nil {
		var ee *exec.ExitError
		if errors.As(err, &ee) && strings.Contains(string(ee.Stderr), "No such file") {
			return nil, nil
		}
		return nil, fmt.Errorf("network: read the sets of table inet %s: %w", p.cfg.Bridge, err)
	}
	return parseCarried(out, ips)
}

// parseCarried reads the output of `nft -j list table inet <bridge>`.
func parseCarried(out []byte, ips map[netip.Addr]bool) (map[netip.Addr]*carriedSlot, error) {
	var doc struct {
		Nftables []nftSetJSON `json:"nftables"`
	}
	if err := json.Unmarshal(out, &doc); err != nil {
		return nil, fmt.Errorf("network: parse nft's listing: %w", err)
	}
	carried := map[netip.Addr]*carriedSlot{}
	slot := func(a netip.Addr) *carriedSlot {
		if carried[a] == nil {
			carried[a] = &carriedSlot{}
		}
		return carried[a]
	}
	for _, obj := range doc.Nftables {
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
			if !ips[src] {
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
// slots it removed go, a kept slot allowed the internet leaves the blocked set, and every
// kept slot starts from the destinations and redirect it holds. Kept slots not allowed
// the internet are added to the blocked set by the caller.
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
