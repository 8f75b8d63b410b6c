package microvm

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"net"
	"net/netip"
	"os"
	"os/exec"
	"strings"

	"github.com/vishvananda/netlink"
	"github.com/vishvananda/netns"
	"golang.org/x/sys/unix"

	"github.com/aenv-dev/aenv/internal/network"
)

// A restored guest keeps the network identity it booted with (address, gateway, MAC: they
// are in its memory), but runs in whatever slot it gets now. Unless that slot has the same
// address, the slot's namespace translates between the two instead of redirecting frames
// (tap.go): the namespace routes the guest's address to the tap, answers the guest's ARP
// for everything else on the subnet (proxy ARP, with the tap wearing the bridge's MAC,
// which the guest has cached for its gateway), and NATs the slot's address to the guest's
// and back. To the host the sandbox is still the slot: its address, its veth, its
// egress rules.

// natTable is the nftables table of the translation in a slot's namespace.
const natTable = "aenv_restored"

// attachRestoredTap creates the tap for a restored guest in slot and sets up the
// namespace for the guest's identity.
func (b *Backend) attachRestoredTap(ctx context.Context, slot *network.Slot, g guestIdentity) (*guestNIC, error) {
	mac, err := net.ParseMAC(g.MAC)
	if err != nil {
		return nil, fmt.Errorf("microvm: guest MAC %q: %w", g.MAC, err)
	}
	br, err := netlink.LinkByName(slot.Bridge) // a node with many slots has several bridges
	if err != nil {
		return nil, fmt.Errorf("microvm: bridge of slot %s: %w", slot.Netns, err)
	}
	if g.Addr.Addr() == slot.IP {
		// The guest's own address (a resume that got its slot back): be that slot as at
		// boot, with the guest's MAC on eth0 and in the bridge's neighbour entry.
		if err := takeMAC(slot, mac); err != nil {
			return nil, err
		}
		return attachTap(slot)
	}
	// The tap must wear the MAC the guest has cached for its gateway, or the namespace
	// drops the guest's frames as meant for another host.
	gwMAC := br.Attrs().HardwareAddr
	if m, err := net.ParseMAC(g.GatewayMAC); err == nil {
		gwMAC = m
	}
	ns, err := netns.GetFromPath(slot.NetnsPath)
	if err != nil {
		return nil, fmt.Errorf("microvm: netns %s: %w", slot.Netns, err)
	}
	defer ns.Close()
	tap, err := openTap(ns, tapName)
	if err != nil {
		return nil, err
	}
	if err := translate(ctx, ns, slot, g.Addr.Addr(), gwMAC); err != nil {
		tap.Close()
		return nil, fmt.Errorf("microvm: restored guest network in %s: %w", slot.Netns, err)
	}
	return &guestNIC{tap: tap, mac: mac}, nil
}

// inheritedRules answer what the guest sends on the connections it holds from before the
// capture with a reset, so they end in the guest at once. A fork child's memory holds
// copies of its parent's connections, with the parent's addresses and sequence numbers;
// conntrack here saw none of them begin, and with tcp_loose off it takes up none of
// their packets, which are then "invalid". Before, a FIN or RST on one left the namespace
// untranslated, from the parent's address, and closed the parent's own connection at its
// peer (TestForkChildLeavesParentConnections); its other packets were taken up as
// connections of the slot, which a new connection to the slot from the same host port
// then matched, missing the translation to the guest. Dropping them instead would leave
// the child's copies retransmitting for minutes. tcp_be_liberal keeps the guest's own
// connections out of "invalid" whatever their windows do, so only the copies are reset.
const inheritedRules = `iifname "` + tapName + `" ct state invalid meta l4proto tcp reject with tcp reset
    iifname "` + tapName + `" ct state invalid drop`

// translate sets up slot's namespace for a guest at guest: the tap (wearing gwMAC, which
// the guest has cached for its gateway) routed to the guest's address and answering ARP
// for the rest of the subnet, forwarding on, and the NAT between the slot's address and
// the guest's. It runs on every fork's critical path, so only the NAT rules take a
// process (nft); the rest is netlink and /proc/sys writes from a thread in the namespace.
func translate(ctx context.Context, ns netns.NsHandle, slot *network.Slot, guest netip.Addr, gwMAC net.HardwareAddr) error {
	err := inNetns(ns, func() error {
		h, err := netlink.NewHandle()
		if err != nil {
			return fmt.Errorf("netlink: %w", err)
		}
		defer h.Close()
		eth, err := h.LinkByName("eth0")
		if err != nil {
			return fmt.Errorf("eth0: %w", err)
		}
		tl, err := h.LinkByName(tapName)
		if err != nil {
			return fmt.Errorf("%s: %w", tapName, err)
		}
		// A slot that held a VM booted in it still redirects eth0 to that VM's tap.
		ingress := &netlink.Ingress{QdiscAttrs: netlink.QdiscAttrs{
			LinkIndex: eth.Attrs().Index, Handle: netlink.MakeHandle(0xffff, 0), Parent: netlink.HANDLE_INGRESS,
		}}
		if err := h.QdiscDel(ingress); err != nil && !errors.Is(err, unix.EINVAL) && !errors.Is(err, unix.ENOENT) {
			return fmt.Errorf("remove the ingress redirect of eth0: %w", err)
		}
		if err := h.LinkSetHardwareAddr(tl, gwMAC); err != nil {
			return fmt.Errorf("MAC of %s: %w", tapName, err)
		}
		if err := h.LinkSetMTU(tl, eth.Attrs().MTU); err != nil {
			return fmt.Errorf("MTU of %s: %w", tapName, err)
		}
		if err := h.LinkSetUp(tl); err != nil {
			return fmt.Errorf("up %s: %w", tapName, err)
		}
		route := &netlink.Route{LinkIndex: tl.Attrs().Index, Dst: &net.IPNet{IP: guest.AsSlice(), Mask: net.CIDRMask(32, 32)}, Scope: netlink.SCOPE_LINK}
		if err := h.RouteReplace(route); err != nil {
			return fmt.Errorf("route to %s: %w", guest, err)
		}
		// /proc/sys/net is the namespace of the thread that opens it. The conntrack
		// settings are inheritedRules'.
		for f, v := range map[string]string{
			"/proc/sys/net/ipv4/ip_forward":                       "1",
			"/proc/sys/net/ipv4/conf/" + tapName + "/proxy_arp":   "1",
			"/proc/sys/net/netfilter/nf_conntrack_tcp_loose":      "0",
			"/proc/sys/net/netfilter/nf_conntrack_tcp_be_liberal": "1",
		} {
			if err := os.WriteFile(f, []byte(v+"\n"), 0o644); err != nil {
				return err
			}
		}
		return nil
	})
	if err != nil {
		return err
	}
	rules := fmt.Sprintf(`table ip %[3]s
delete table ip %[3]s
table ip %[3]s {
  chain pre { type nat hook prerouting priority dstnat; iifname "eth0" ip daddr %[2]s dnat to %[1]s; }
  chain post { type nat hook postrouting priority srcnat; oifname "eth0" ip saddr %[1]s snat to %[2]s; }
  chain inherited {
    type filter hook forward priority filter;
    %[4]s
  }
}
`, guest, slot.IP, natTable, inheritedRules)
	cmd := exec.CommandContext(ctx, "nsenter", "--net="+slot.NetnsPath, "nft", "-f", "-")
	cmd.Stdin = strings.NewReader(rules)
	var out bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &out
	if err := cmd.Run(); err != nil {
		return fmt.Errorf("nft: %w: %s", err, strings.TrimSpace(out.String()))
	}
	return nil
}

// gatewayLink is the host interface holding the slots' gateway address: the bridge.
func gatewayLink(gw netip.Addr) (netlink.Link, error) {
	addrs, err := netlink.AddrList(nil, netlink.FAMILY_V4)
	if err != nil {
		return nil, fmt.Errorf("microvm: host addresses: %w", err)
	}
	for _, a := range addrs {
		if ip, ok := netip.AddrFromSlice(a.IP); ok && ip.Unmap() == gw {
			return netlink.LinkByIndex(a.LinkIndex)
		}
	}
	return nil, fmt.Errorf("microvm: no host interface has the gateway address %s", gw)
}

// takeMAC gives slot's eth0 the MAC mac and points the host's entries for the slot at it.
func takeMAC(slot *network.Slot, mac net.HardwareAddr) error {
	ns, err := netns.GetFromPath(slot.NetnsPath)
	if err != nil {
		return fmt.Errorf("microvm: netns %s: %w", slot.Netns, err)
	}
	defer ns.Close()
	h, err := netlink.NewHandleAt(ns)
	if err != nil {
		return fmt.Errorf("microvm: netlink in %s: %w", slot.Netns, err)
	}
	defer h.Close()
	eth, err := h.LinkByName("eth0")
	if err != nil {
		return fmt.Errorf("microvm: eth0 in %s: %w", slot.Netns, err)
	}
	if err := h.LinkSetHardwareAddr(eth, mac); err != nil {
		return fmt.Errorf("microvm: MAC of eth0 in %s: %w", slot.Netns, err)
	}
	if err := network.PinMAC(slot, mac); err != nil {
		return fmt.Errorf("microvm: %w", err)
	}
	return nil
}

// pinBridgeMAC makes the bridge keep its current MAC. A Linux bridge otherwise takes the
// lowest MAC of its ports, which changes as slots come and go, while every guest keeps the
// MAC it saw for its gateway in memory across snapshots and restores. Setting the address
// (to the same value) marks it as assigned, and the bridge stops recalculating it.
func pinBridgeMAC(gw netip.Addr) error {
	br, err := gatewayLink(gw)
	if err != nil {
		return err
	}
	if err := netlink.LinkSetHardwareAddr(br, br.Attrs().HardwareAddr); err != nil {
		return fmt.Errorf("microvm: pin the bridge's MAC: %w", err)
	}
	return nil
}
