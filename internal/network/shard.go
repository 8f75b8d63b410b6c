package network

import (
	"context"
	"errors"
	"fmt"
	"net"
	"os"
	"sort"
	"strconv"
	"strings"

	"github.com/vishvananda/netlink"
)

// A Linux bridge takes at most 1023 ports (BR_MAX_PORTS is 1024, port 0 excluded): the
// 1024th veth fails with EXFULL, "exchange full", so one bridge caps a node at about a
// thousand sandboxes. Slots are therefore spread over bridges of Config.BridgePorts
// (at most maxBridgePorts) ports each: slot i is on bridge i/BridgePorts, the first being network.bridge and the others
// "<network.bridge>-<k>". Every bridge wears the gateway address (the extra ones as a
// /32, so the subnet's route stays on the first), and each slot of an extra bridge gets a
// host route of its own; the nftables rules match the bridges through the set
// "bridges". Sandboxes see the same subnet, gateway address and rules whichever bridge
// they are on.
const maxBridgePorts = 1000

// bridgeFor names the bridge of slot index i.
func (p *Pool) bridgeFor(i int) string {
	if k := i / p.cfg.BridgePorts; k > 0 {
		return p.cfg.Bridge + "-" + strconv.Itoa(k)
	}
	return p.cfg.Bridge
}

// ensureShard makes sure the extra bridge name exists, is up, wears the gateway address
// and is in the rules' set of bridges. Idempotent; the first bridge is made by New.
func (p *Pool) ensureShard(ctx context.Context, name string) error {
	p.shardMu.Lock()
	defer p.shardMu.Unlock()
	if name == p.cfg.Bridge || p.shards[name] {
		return nil
	}
	if len(name) > 15 {
		return fmt.Errorf("network: more than %d sandboxes need bridge %s, a name longer than 15 characters: shorten network.bridge", p.cfg.BridgePorts, name)
	}
	if err := p.ensureBridgeNamed(name, 32); err != nil {
		return err
	}
	if err := nft(ctx, fmt.Sprintf("add element inet %s bridges { %q }\n", p.cfg.Bridge, name)); err != nil {
		return fmt.Errorf("network: add bridge %s to the rules: %w", name, err)
	}
	p.shards[name] = true
	return nil
}

// shardBridges lists the extra bridges of this pool found on the host, in order.
func (p *Pool) shardBridges() []string {
	links, err := netlink.LinkList()
	if err != nil {
		return nil
	}
	return p.shardBridgesIn(links)
}

// shardBridgesIn is shardBridges with the host's links already listed.
func (p *Pool) shardBridgesIn(links []netlink.Link) []string {
	var out []string
	for _, l := range links {
		if _, ok := p.parseIndex(l.Attrs().Name, p.cfg.Bridge+"-"); ok && l.Type() == "bridge" {
			out = append(out, l.Attrs().Name)
		}
	}
	sort.Strings(out)
	return out
}

// bridgesSet is the nftables set of the pool's bridges (of links, the host's), for the rules.
func (p *Pool) bridgesSet(links []netlink.Link) string {
	names := append([]string{p.cfg.Bridge}, p.shardBridgesIn(links)...)
	for i, n := range names {
		names[i] = strconv.Quote(n)
	}
	return fmt.Sprintf("\tset bridges { type ifname; elements = { %s }; }\n", strings.Join(names, ", "))
}

// slotRoute is the host route of a slot on an extra bridge (nil on the first one, which
// the subnet's route covers).
func (p *Pool) slotRoute(s *Slot, br netlink.Link) *netlink.Route {
	if s.Bridge == p.cfg.Bridge {
		return nil
	}
	return &netlink.Route{
		LinkIndex: br.Attrs().Index, Scope: netlink.SCOPE_LINK, Src: p.gateway.AsSlice(),
		Dst: &net.IPNet{IP: s.IP.AsSlice(), Mask: net.CIDRMask(32, 32)},
	}
}

// removeShards deletes the extra bridges (Teardown).
func (p *Pool) removeShards() error {
	var errs []error
	for _, name := range p.shardBridges() {
		if l, err := netlink.LinkByName(name); err == nil {
			if err := netlink.LinkDel(l); err != nil && !errors.Is(err, os.ErrNotExist) {
				errs = append(errs, fmt.Errorf("network: delete bridge %s: %w", name, err))
			}
		}
	}
	return errors.Join(errs...)
}
