package network

import (
	"bytes"
	"context"
	"fmt"
	"net/netip"
	"os"
	"os/exec"
	"strings"

	"github.com/vishvananda/netlink"
)

// The rules live in two tables named after the bridge, replaced atomically in one nft
// transaction:
//
//   - inet: input drops everything a sandbox starts towards the host (any host address,
//     any port) while replies to connections the host opened (envd, user ports) pass;
//     forward drops sandbox-to-sandbox routing, connections from outside into sandboxes,
//     spoofed sources, infrastructure ranges (infra.go), sources in the "blocked" set
//     (no internet) and per-slot egress rules (egress.go); postrouting
//     masquerades the subnet; prerouting redirects the TCP of proxied slots to the
//     egress proxy, which input lets in (proxied.go).
//   - bridge: forward drops frames between two sandbox ports, in addition to the kernel's
//     isolated-port flag set on each veth.
//
// rules is the transaction that replaces both tables with inet and bridge (p.tables).
func (p *Pool) rules(inet, bridge string) string {
	return fmt.Sprintf("table inet %[1]s {}\ndelete table inet %[1]s\ntable bridge %[1]s {}\ndelete table bridge %[1]s\n", p.cfg.Bridge) +
		inet + bridge
}

// tables are the two tables' definitions, each holding the rules' fingerprint
// (tables.go) as a rule comment; links are the host's links (for the extra bridges).
func (p *Pool) tables(links []netlink.Link) (inet, bridge string) {
	bridges := p.bridgesSet(links)
	inet, bridge = p.tableText(bridges, "")
	return p.tableText(bridges, fingerprint(p.proxyPort, inet+bridge))
}

// tableText writes the two tables, with the set of bridges bridges and comment on their
// last rule.
func (p *Pool) tableText(bridges, comment string) (inet, bridge string) {
	br, sub, pre := p.cfg.Bridge, p.subnet.String(), p.cfg.Prefix
	sets, prerouting, input, fwd := p.proxyRules()
	if comment != "" {
		comment = fmt.Sprintf(" comment %q", comment)
	}
	inet = fmt.Sprintf(`table inet %[1]s {
%[9]s	set blocked { type ipv4_addr; }
	set egress_allow { type ipv4_addr . ipv4_addr; flags interval; }
	set egress_deny { type ipv4_addr . ipv4_addr; flags interval; }
%[4]s%[5]s%[6]s	chain input {
		type filter hook input priority filter - 10; policy accept;
		iifname @bridges ct state established,related accept
%[7]s		iifname @bridges drop
	}
	chain forward {
		type filter hook forward priority filter - 10; policy accept;
		iifname @bridges oifname @bridges drop
		oifname @bridges ct state established,related accept
		oifname @bridges drop
		iifname @bridges ip saddr != %[2]s drop
		iifname @bridges ip daddr @infra_deny jump infra
%[8]s		iifname @bridges ip saddr . ip daddr @egress_allow accept
		iifname @bridges ip saddr @blocked drop
		iifname @bridges ip saddr . ip daddr @egress_deny drop
		iifname @bridges meta nfproto ipv6 drop
	}
	chain postrouting {
		type nat hook postrouting priority srcnat; policy accept;
		ip saddr %[2]s oifname != @bridges masquerade%[10]s
	}
}
`, br, sub, pre, p.infraRules(), sets, prerouting, input, fwd, bridges, comment)
	bridge = fmt.Sprintf(`table bridge %[1]s {
	chain forward {
		type filter hook forward priority filter; policy accept;
		iifname "%[2]sh*" oifname "%[2]sh*" drop%[3]s
	}
}
`, br, pre, comment)
	return inet, bridge
}

// installRules replaces the tables with inet and bridge (p.tables) and, in the same
// transaction, puts back the set elements of the slots an earlier run left (carry.go);
// keep: the installed tables are already these rules (tables.go) and stay, elements and all.
func (p *Pool) installRules(ctx context.Context, inet, bridge string, carried map[netip.Addr]*carriedSlot, keep bool) error {
	if !keep {
		if err := nft(ctx, p.rules(inet, bridge)+p.carriedScript(carried)); err != nil {
			return fmt.Errorf("network: install nftables rules: %w", err)
		}
	}
	// Forwarding is needed for outbound NAT; it is what every container engine sets.
	if err := os.WriteFile("/proc/sys/net/ipv4/ip_forward", []byte("1"), 0o644); err != nil {
		return fmt.Errorf("network: enable ip_forward: %w", err)
	}
	return nil
}

func (p *Pool) removeRules(ctx context.Context) error {
	br := p.cfg.Bridge
	script := fmt.Sprintf("table inet %[1]s {}\ndelete table inet %[1]s\ntable bridge %[1]s {}\ndelete table bridge %[1]s\n", br)
	if err := nft(ctx, script); err != nil {
		return fmt.Errorf("network: remove nftables rules: %w", err)
	}
	return nil
}

// setInternet adds (allow=false) or removes (allow=true) the slot's address in the
// blocked set.
func (p *Pool) setInternet(ctx context.Context, s *Slot, allow bool) error {
	op := "add"
	if allow {
		// "destroy" would not fail on a missing element but needs nft >= 1.0.8; add first so
		// delete always finds it.
		if err := nft(ctx, fmt.Sprintf("add element inet %s blocked { %s }\ndelete element inet %s blocked { %s }\n",
			p.cfg.Bridge, s.IP, p.cfg.Bridge, s.IP)); err != nil {
			return fmt.Errorf("network: allow internet for %s: %w", s.IP, err)
		}
		return nil
	}
	if err := nft(ctx, fmt.Sprintf("%s element inet %s blocked { %s }\n", op, p.cfg.Bridge, s.IP)); err != nil {
		return fmt.Errorf("network: block internet for %s: %w", s.IP, err)
	}
	return nil
}

func nft(ctx context.Context, script string) error {
	cmd := exec.CommandContext(ctx, "nft", "-f", "-")
	cmd.Stdin = strings.NewReader(script)
	var out bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &out
	if err := cmd.Run(); err != nil {
		return fmt.Errorf("nft: %w: %s", err, strings.TrimSpace(out.String()))
	}
	return nil
}
