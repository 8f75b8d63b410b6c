package microvm

import (
	"bytes"
	"context"
	"fmt"
	"net"
	"net/netip"
	"os/exec"
	"strings"

	"github.com/vishvananda/netlink"
	"github.com/vishvananda/netns"

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
	br, err := gatewayLink(b.pool.Gateway())
	if err != nil {
		return nil, err
	}
	if g.Addr.Addr() == slot.IP {
		// The guest's own address (a resume that got its slot back): be that slot as at
		// boot, with the guest's MAC on eth0 and in the bridge's neighbour entry.
		if err := takeMAC(slot, br, mac); err != nil {
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
	script := fmt.Sprintf(`set -e
tc qdisc del dev eth0 ingress 2>/dev/null || true
ip link set dev %[1]s address %[2]s mtu $(cat /sys/class/net/eth0/mtu) up
ip route replace %[3]s/32 dev %[1]s
echo 1 > /proc/sys/net/ipv4/ip_forward
echo 1 > /proc/sys/net/ipv4/conf/%[1]s/proxy_arp
nft -f - <<EOF
table ip %[5]s
delete table ip %[5]s
table ip %[5]s {
  chain pre { type nat hook prerouting priority dstnat; iifname "eth0" ip daddr %[4]s dnat to %[3]s; }
  chain post { type nat hook postrouting priority srcnat; oifname "eth0" ip saddr %[3]s snat to %[4]s; }
}
EOF
`, tapName, gwMAC, g.Addr.Addr(), slot.IP, natTable)
	cmd := exec.CommandContext(ctx, "nsenter", "--net="+slot.NetnsPath, "sh", "-c", script)
	var out bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &out
	if err := cmd.Run(); err != nil {
		tap.Close()
		return nil, fmt.Errorf("microvm: restored guest network in %s: %w: %s", slot.Netns, err, strings.TrimSpace(out.String()))
	}
	return &guestNIC{tap: tap, mac: mac}, nil
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

// takeMAC gives slot's eth0 the MAC mac and points the bridge's permanent neighbour entry
// for the slot's address at it.
func takeMAC(slot *network.Slot, br netlink.Link, mac net.HardwareAddr) error {
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
	neigh := &netlink.Neigh{LinkIndex: br.Attrs().Index, Family: netlink.FAMILY_V4, State: netlink.NUD_PERMANENT,
		IP: slot.IP.AsSlice(), HardwareAddr: mac}
	if err := netlink.NeighSet(neigh); err != nil {
		return fmt.Errorf("microvm: neighbour entry for %s: %w", slot.IP, err)
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
