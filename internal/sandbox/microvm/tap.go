package microvm

import (
	"errors"
	"fmt"
	"net"
	"os"
	"runtime"

	"github.com/vishvananda/netlink"
	"github.com/vishvananda/netns"
	"golang.org/x/sys/unix"

	"github.com/aenv-dev/aenv/internal/network"
)

// The guest's network: a tap device inside the sandbox's network slot, joined to the slot's
// eth0 (the veth into the host bridge) by two tc redirects (every frame that arrives on one
// leaves through the other; the namespace's own stack never sees them). The guest takes
// eth0's MAC and the slot's address, so to the host the VM is indistinguishable from a
// container in that slot: the bridge's permanent neighbour entry, the node's proxy to
// envd and user ports, NAT and the egress rules (all keyed on the slot's address and
// veth) apply unchanged. The tap is not persistent: it lives as long as the QEMU that
// holds its descriptor, so a dead VM leaves no interface behind, and the slot's
// namespace (with the redirects) goes when the slot is released.

// tapName is the tap device's name inside the slot's namespace.
const tapName = "tap0"

// guestNIC is what the guest needs to be the slot.
type guestNIC struct {
	tap *os.File // the tap's queue, handed to QEMU (-netdev tap,fd=)
	mac net.HardwareAddr
}

// attachTap creates the tap in slot's namespace, redirects it to and from eth0, and
// returns its descriptor and the MAC the guest must use.
func attachTap(slot *network.Slot) (_ *guestNIC, err error) {
	ns, err := netns.GetFromPath(slot.NetnsPath)
	if err != nil {
		return nil, fmt.Errorf("microvm: netns %s: %w", slot.Netns, err)
	}
	defer ns.Close()
	tap, err := openTap(ns, tapName)
	if err != nil {
		return nil, err
	}
	defer func() {
		if err != nil {
			tap.Close()
		}
	}()
	h, err := netlink.NewHandleAt(ns)
	if err != nil {
		return nil, fmt.Errorf("microvm: netlink in %s: %w", slot.Netns, err)
	}
	defer h.Close()
	eth, err := h.LinkByName("eth0")
	if err != nil {
		return nil, fmt.Errorf("microvm: eth0 in %s: %w", slot.Netns, err)
	}
	tl, err := h.LinkByName(tapName)
	if err != nil {
		return nil, fmt.Errorf("microvm: %s in %s: %w", tapName, slot.Netns, err)
	}
	if err := h.LinkSetMTU(tl, eth.Attrs().MTU); err != nil {
		return nil, fmt.Errorf("microvm: mtu of %s: %w", tapName, err)
	}
	if err := h.LinkSetUp(tl); err != nil {
		return nil, fmt.Errorf("microvm: up %s: %w", tapName, err)
	}
	for _, pair := range [][2]netlink.Link{{eth, tl}, {tl, eth}} {
		if err := redirect(h, pair[0], pair[1]); err != nil {
			return nil, fmt.Errorf("microvm: redirect %s -> %s in %s: %w", pair[0].Attrs().Name, pair[1].Attrs().Name, slot.Netns, err)
		}
	}
	return &guestNIC{tap: tap, mac: eth.Attrs().HardwareAddr}, nil
}

// inNetns runs f on a thread that has entered ns. If the thread cannot get back to the
// process's namespace it stays locked, and Go discards it when f's goroutine ends.
func inNetns(ns netns.NsHandle, f func() error) error {
	ch := make(chan error, 1)
	go func() {
		runtime.LockOSThread()
		orig, err := netns.Get()
		if err != nil {
			runtime.UnlockOSThread()
			ch <- fmt.Errorf("microvm: current netns: %w", err)
			return
		}
		defer orig.Close()
		if err := netns.Set(ns); err != nil {
			runtime.UnlockOSThread()
			ch <- fmt.Errorf("microvm: enter netns: %w", err)
			return
		}
		ferr := f()
		if err := netns.Set(orig); err != nil {
			ch <- errors.Join(ferr, fmt.Errorf("microvm: restore netns: %w", err))
			return
		}
		runtime.UnlockOSThread()
		ch <- ferr
	}()
	return <-ch
}

// openTap creates tap device name in ns (a TUNSETIFF on a fresh /dev/net/tun descriptor
// acts in the calling thread's namespace) with virtio-net headers, so QEMU can pass
// offloads through.
func openTap(ns netns.NsHandle, name string) (f *os.File, err error) {
	err = inNetns(ns, func() error {
		f, err = tunSetIff(name)
		return err
	})
	if err != nil && f != nil {
		f.Close()
		f = nil
	}
	return f, err
}

func tunSetIff(name string) (*os.File, error) {
	fd, err := unix.Open("/dev/net/tun", unix.O_RDWR|unix.O_CLOEXEC, 0)
	if err != nil {
		return nil, fmt.Errorf("microvm: open /dev/net/tun: %w", err)
	}
	ifr, err := unix.NewIfreq(name)
	if err != nil {
		unix.Close(fd)
		return nil, fmt.Errorf("microvm: tap name %q: %w", name, err)
	}
	ifr.SetUint16(unix.IFF_TAP | unix.IFF_NO_PI | unix.IFF_VNET_HDR)
	if err := unix.IoctlIfreq(fd, unix.TUNSETIFF, ifr); err != nil {
		unix.Close(fd)
		return nil, fmt.Errorf("microvm: create tap %s: %w", name, err)
	}
	return os.NewFile(uintptr(fd), "/dev/net/tun:"+name), nil
}

// redirect sends every frame arriving on from out of to (an ingress qdisc with a
// match-all u32 filter and a mirred egress redirect).
func redirect(h *netlink.Handle, from, to netlink.Link) error {
	ingress := &netlink.Ingress{QdiscAttrs: netlink.QdiscAttrs{
		LinkIndex: from.Attrs().Index, Handle: netlink.MakeHandle(0xffff, 0), Parent: netlink.HANDLE_INGRESS,
	}}
	// A slot re-attached to a new VM still has the redirect to the previous VM's tap.
	if err := h.QdiscDel(ingress); err != nil && !errors.Is(err, unix.EINVAL) && !errors.Is(err, unix.ENOENT) {
		return fmt.Errorf("remove old ingress qdisc: %w", err)
	}
	if err := h.QdiscAdd(ingress); err != nil {
		return fmt.Errorf("ingress qdisc: %w", err)
	}
	f := &netlink.U32{
		FilterAttrs: netlink.FilterAttrs{
			LinkIndex: from.Attrs().Index, Parent: netlink.MakeHandle(0xffff, 0), Priority: 1, Protocol: unix.ETH_P_ALL,
		},
		Actions: []netlink.Action{&netlink.MirredAction{
			ActionAttrs:  netlink.ActionAttrs{Action: netlink.TC_ACT_STOLEN},
			MirredAction: netlink.TCA_EGRESS_REDIR,
			Ifindex:      to.Attrs().Index,
		}},
	}
	if err := h.FilterAdd(f); err != nil {
		return fmt.Errorf("u32 filter: %w", err)
	}
	return nil
}
