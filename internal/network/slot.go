package network

import (
	"context"
	"errors"
	"fmt"
	"net"
	"os"
	"runtime"

	"github.com/vishvananda/netlink"
	"github.com/vishvananda/netlink/nl"
	"github.com/vishvananda/netns"
	"golang.org/x/sys/unix"
)

// create builds the slot's namespace: a named netns, a veth pair whose host end is an
// isolated port of the bridge and whose other end is eth0 inside, addresses and routes.
func (p *Pool) create(s *Slot) error {
	ns, err := newNamedNetns(s.Netns)
	if err != nil {
		return err
	}
	defer ns.Close()

	// The pool's operations take no context; a slot's nft call is one short transaction.
	if err := p.ensureShard(context.Background(), s.Bridge); err != nil {
		return err
	}
	br, err := netlink.LinkByName(s.Bridge)
	if err != nil {
		return fmt.Errorf("network: bridge %s: %w", s.Bridge, err)
	}
	veth := &netlink.Veth{
		LinkAttrs:     netlink.LinkAttrs{Name: s.HostVeth, MTU: p.cfg.MTU, MasterIndex: br.Attrs().Index},
		PeerName:      "eth0",
		PeerNamespace: netlink.NsFd(int(ns)),
	}
	if err := netlink.LinkAdd(veth); err != nil {
		return fmt.Errorf("network: veth %s: %w", s.HostVeth, err)
	}
	host, err := netlink.LinkByName(s.HostVeth)
	if err != nil {
		return fmt.Errorf("network: veth %s: %w", s.HostVeth, err)
	}
	if err := p.noHostIPv6(s.HostVeth); err != nil {
		return err
	}
	// Isolated bridge ports can only talk to non-isolated ones (the bridge itself), so
	// sandboxes never see each other at layer 2.
	if err := netlink.LinkSetIsolated(host, true); err != nil {
		return fmt.Errorf("network: isolate %s: %w", s.HostVeth, err)
	}
	if err := netlink.LinkSetUp(host); err != nil {
		return fmt.Errorf("network: up %s: %w", s.HostVeth, err)
	}

	h, err := netlink.NewHandleAt(ns)
	if err != nil {
		return fmt.Errorf("network: netlink in %s: %w", s.Netns, err)
	}
	defer h.Close()
	lo, err := h.LinkByName("lo")
	if err != nil {
		return fmt.Errorf("network: lo in %s: %w", s.Netns, err)
	}
	if err := h.LinkSetUp(lo); err != nil {
		return fmt.Errorf("network: up lo in %s: %w", s.Netns, err)
	}
	eth, err := h.LinkByName("eth0")
	if err != nil {
		return fmt.Errorf("network: eth0 in %s: %w", s.Netns, err)
	}
	addr := &netlink.Addr{IPNet: &net.IPNet{IP: s.IP.AsSlice(), Mask: net.CIDRMask(s.PrefixLen, 32)}}
	if err := h.AddrAdd(eth, addr); err != nil {
		return fmt.Errorf("network: address in %s: %w", s.Netns, err)
	}
	// No IPv6 address on eth0 (lo keeps ::1): the bridge drops IPv6 anyway, and each
	// address would make the namespace send DAD, router and MLD packets whose multicast
	// neighbour entries fill the host's one IPv6 neighbour table (see gatewayNeigh).
	if err := h.LinkSetIP6AddrGenMode(eth, nl.IN6_ADDR_GEN_MODE_NONE); err != nil && !errors.Is(err, unix.EAFNOSUPPORT) {
		return fmt.Errorf("network: no IPv6 address on eth0 in %s: %w", s.Netns, err)
	}
	if err := h.LinkSetUp(eth); err != nil {
		return fmt.Errorf("network: up eth0 in %s: %w", s.Netns, err)
	}
	route := &netlink.Route{LinkIndex: eth.Attrs().Index, Gw: s.Gateway.AsSlice()}
	if err := h.RouteAdd(route); err != nil {
		return fmt.Errorf("network: default route in %s: %w", s.Netns, err)
	}
	if err := h.NeighSet(gatewayNeigh(eth, s, br)); err != nil {
		return fmt.Errorf("network: gateway neighbour entry in %s: %w", s.Netns, err)
	}
	if err := pinMAC(s, br, host, eth.Attrs().HardwareAddr); err != nil {
		return err
	}
	if r := p.slotRoute(s, br); r != nil {
		if err := netlink.RouteReplace(r); err != nil {
			return fmt.Errorf("network: host route to %s: %w", s.IP, err)
		}
	}
	return nil
}

// pinMAC points the host at mac for slot s, whose host end is port on bridge br. A
// permanent neighbour entry on the bridge: a reused address never hits a stale ARP entry
// of the slot's previous owner, and no sandbox can claim another's address by ARP. A
// static forwarding entry on the port: the bridge otherwise learns a MAC only from a
// frame the sandbox sends, and floods every frame to a MAC it has not learned (or whose
// entry aged out, after 5 idle minutes) to all its ports: the node's first SYN to each
// new sandbox was copied to up to 1 000 ports (~1.5 ms of the create's CPU at 1 500 held).
func pinMAC(s *Slot, br, port netlink.Link, mac net.HardwareAddr) error {
	neigh := &netlink.Neigh{
		LinkIndex: br.Attrs().Index, Family: netlink.FAMILY_V4, State: netlink.NUD_PERMANENT,
		IP: s.IP.AsSlice(), HardwareAddr: mac,
	}
	if err := netlink.NeighSet(neigh); err != nil {
		return fmt.Errorf("network: neighbour entry for %s: %w", s.IP, err)
	}
	fdb := &netlink.Neigh{
		LinkIndex: port.Attrs().Index, Family: unix.AF_BRIDGE, Flags: netlink.NTF_MASTER,
		State: netlink.NUD_NOARP, HardwareAddr: mac, // static, not local (NUD_PERMANENT)
	}
	if err := netlink.NeighSet(fdb); err != nil {
		return fmt.Errorf("network: forwarding entry for %s on %s: %w", mac, s.HostVeth, err)
	}
	return nil
}

// PinMAC points the host at mac for slot s, after its eth0 took that MAC (a restored
// microVM's guest keeps the one it booted with): see pinMAC. The entries for the MAC it
// had go with the slot.
func PinMAC(s *Slot, mac net.HardwareAddr) error {
	br, err := netlink.LinkByName(s.Bridge)
	if err != nil {
		return fmt.Errorf("network: bridge %s: %w", s.Bridge, err)
	}
	port, err := netlink.LinkByName(s.HostVeth)
	if err != nil {
		return fmt.Errorf("network: veth %s: %w", s.HostVeth, err)
	}
	return pinMAC(s, br, port, mac)
}

// gatewayNeigh is the slot's permanent neighbour entry for its gateway (the bridge, whose
// MAC ensureShard pinned). The kernel keeps one ARP table for all namespaces, and its
// garbage-collection thresholds (net.ipv4.neigh.default.gc_thresh3, 1 024 by default)
// count every namespace's learned entries; permanent ones are exempt. Learned, each
// sandbox's gateway entry counted, so beyond ~1 000 sandboxes the table sat at its limit:
// an entry idle for 5 s was evicted whenever another was needed, and when nothing could
// be evicted the new one was refused and the packet that needed it dropped (the lost
// first SYN-ACK: a 1 s retransmit on ~3 % of first commands, /proc/net/stat/arp_cache
// table_fulls). Permanent, it also spares every first packet an ARP round trip.
func gatewayNeigh(eth netlink.Link, s *Slot, br netlink.Link) *netlink.Neigh {
	return &netlink.Neigh{
		LinkIndex: eth.Attrs().Index, Family: netlink.FAMILY_V4, State: netlink.NUD_PERMANENT,
		IP: s.Gateway.AsSlice(), HardwareAddr: br.Attrs().HardwareAddr,
	}
}

// noHostIPv6 turns IPv6 off on the host end of a slot's veth before it goes up. The
// rules drop every IPv6 packet from the bridges, so the port needs no IPv6; left on, each
// port puts four routes in the host's IPv6 table (its link-local prefix and address, two
// multicast), and the kernel walks that whole table whenever a link goes away (fib6_ifdown
// in LinkDel): at ~1 500 host veths that walk was ~2 ms of every kill's CPU, growing with
// the sandboxes held. Through a directory fd opened once, so the write does not look up
// /proc/sys/net by name (a lookup that compares against every namespace's entry).
// A host without IPv6 has nothing to turn off.
func (p *Pool) noHostIPv6(dev string) error {
	p.v6Once.Do(func() {
		p.v6Conf = -1
		fd, err := unix.Open("/proc/sys/net/ipv6/conf", unix.O_RDONLY|unix.O_DIRECTORY|unix.O_CLOEXEC, 0)
		if err == nil {
			p.v6Conf = fd
		}
	})
	if p.v6Conf < 0 {
		return nil
	}
	fd, err := unix.Openat(p.v6Conf, dev+"/disable_ipv6", unix.O_WRONLY|unix.O_CLOEXEC, 0)
	if errors.Is(err, unix.ENOENT) {
		return nil
	}
	if err != nil {
		return fmt.Errorf("network: turn IPv6 off on %s: %w", dev, err)
	}
	defer unix.Close(fd)
	if _, err := unix.Write(fd, []byte("1")); err != nil {
		return fmt.Errorf("network: turn IPv6 off on %s: %w", dev, err)
	}
	return nil
}

// newNamedNetns creates a network namespace bind-mounted at /run/netns/name without
// moving the calling goroutine's thread for longer than the creation itself.
func newNamedNetns(name string) (netns.NsHandle, error) {
	runtime.LockOSThread()
	orig, err := netns.Get()
	if err != nil {
		runtime.UnlockOSThread()
		return netns.None(), fmt.Errorf("network: current netns: %w", err)
	}
	defer orig.Close()
	ns, nerr := netns.NewNamed(name)
	if nerr == nil {
		nerr = tuneNetns()
	}
	if serr := netns.Set(orig); serr != nil {
		// The thread is stuck in the wrong namespace: leave it locked so Go discards it.
		if nerr == nil {
			ns.Close()
		}
		return netns.None(), fmt.Errorf("network: restore netns: %w", serr)
	}
	runtime.UnlockOSThread()
	if nerr != nil {
		if ns.IsOpen() {
			ns.Close()
		}
		return netns.None(), fmt.Errorf("network: create netns %s: %w", name, nerr)
	}
	return ns, nil
}

// netnsSysctls are set inside every sandbox namespace, relative to /proc/sys/net/ipv4.
// The namespace belongs to the host's user namespace, so a sandbox root (even in its own
// user namespace) holds no network capability over it: it cannot change addresses, routes
// or MACs, send raw frames or spoof ARP. These let it still do what users expect: bind
// ports below 1024 (web servers on :80) and ping through unprivileged ICMP sockets.
var netnsSysctls = map[string]string{
	"ip_unprivileged_port_start": "0",
	"ping_group_range":           "0 2147483647",
}

// tuneNetns writes netnsSysctls; the calling thread must be in the target namespace
// (/proc/sys/net follows the opening thread's namespace). It looks the directory up in
// a procfs instance of its own (sysctlDir): every namespace whose sysctls were opened
// through a procfs keeps an "ipv4" entry cached below that procfs's one /proc/sys/net,
// and a lookup by name compares against all of them (proc_sys_compare), so through the
// host's /proc it cost ~3 ms of the create's CPU at 1 500 sandboxes held, growing.
func tuneNetns() error {
	dir, err := sysctlDir()
	if err != nil {
		return err
	}
	defer unix.Close(dir)
	for k, v := range netnsSysctls {
		fd, err := unix.Openat(dir, k, unix.O_WRONLY|unix.O_CLOEXEC, 0)
		if err != nil {
			return fmt.Errorf("sysctl net/ipv4/%s: %w", k, err)
		}
		_, err = unix.Write(fd, []byte(v))
		unix.Close(fd)
		if err != nil {
			return fmt.Errorf("sysctl net/ipv4/%s: %w", k, err)
		}
	}
	return nil
}

// sysctlDir opens net/ipv4 of /proc/sys in a new procfs instance (its own superblock
// and dentries since Linux 5.8, mounted nowhere, gone when closed: ~30 µs), or through
// /proc where the kernel cannot make one.
func sysctlDir() (int, error) {
	if fs, err := unix.Fsopen("proc", unix.FSOPEN_CLOEXEC); err == nil {
		defer unix.Close(fs)
		if err := unix.FsconfigCreate(fs); err == nil {
			m, err := unix.Fsmount(fs, unix.FSMOUNT_CLOEXEC, unix.MOUNT_ATTR_NOSUID|unix.MOUNT_ATTR_NODEV|unix.MOUNT_ATTR_NOEXEC)
			if err == nil {
				defer unix.Close(m)
				dir, err := unix.Openat(m, "sys/net/ipv4", unix.O_RDONLY|unix.O_DIRECTORY|unix.O_CLOEXEC, 0)
				if err != nil {
					return -1, fmt.Errorf("sysctl: open net/ipv4 in a new procfs: %w", err)
				}
				return dir, nil
			}
		}
	}
	dir, err := unix.Open("/proc/sys/net/ipv4", unix.O_RDONLY|unix.O_DIRECTORY|unix.O_CLOEXEC, 0)
	if err != nil {
		return -1, fmt.Errorf("sysctl: open /proc/sys/net/ipv4: %w", err)
	}
	return dir, nil
}

// unrouteSlot removes the host's neighbour entry and route to the slot's address, both
// absent on a half-built slot.
func (p *Pool) unrouteSlot(s *Slot) {
	if br, err := netlink.LinkByName(s.Bridge); err == nil {
		_ = netlink.NeighDel(&netlink.Neigh{LinkIndex: br.Attrs().Index, Family: netlink.FAMILY_V4, IP: s.IP.AsSlice()})
		if r := p.slotRoute(s, br); r != nil {
			_ = netlink.RouteDel(r)
		}
	}
}

// destroy removes the slot's veth (both ends go at once) and its namespace. Missing parts
// are not errors, so it is idempotent and sweeps half-built slots.
func (p *Pool) destroy(s *Slot) error {
	var errs []error
	p.unrouteSlot(s)
	if l, err := netlink.LinkByName(s.HostVeth); err == nil {
		if err := netlink.LinkDel(l); err != nil {
			errs = append(errs, fmt.Errorf("network: delete %s: %w", s.HostVeth, err))
		}
	}
	if _, err := os.Lstat(s.NetnsPath); err == nil {
		if err := netns.DeleteNamed(s.Netns); err != nil && !errors.Is(err, os.ErrNotExist) {
			// Not a mountpoint any more (half-built): just remove the file.
			if rerr := os.Remove(s.NetnsPath); rerr != nil && !errors.Is(rerr, os.ErrNotExist) {
				errs = append(errs, fmt.Errorf("network: delete netns %s: %w", s.Netns, err))
			}
		}
	}
	return errors.Join(errs...)
}
