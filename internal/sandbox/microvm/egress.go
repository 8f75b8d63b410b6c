package microvm

import (
	"context"
	"fmt"
	"net/netip"

	"github.com/aenv-dev/aenv/internal/sandbox"
)

// A VM's tap lives in its network slot's namespace and the guest holds the slot's
// address, so the node's outbound rules (the address sets of the forward chain and the
// redirect to the egress proxy, both keyed by the slot's address on the host side) apply
// to a VM exactly as to a container.

var _ sandbox.EgressUpdater = (*Instance)(nil)

// UpdateEgress implements sandbox.EgressUpdater on the VM's network slot: outbound NAT
// for AllowInternet, the allow and deny destinations, and the egress proxy for domains,
// request transforms and a SOCKS5 tunnel. A stopped VM has no slot and reports ErrGone.
func (i *Instance) UpdateEgress(ctx context.Context, e sandbox.Egress) error {
	i.mu.Lock()
	slot, stopped := i.slot, i.stopped
	i.mu.Unlock()
	if stopped || slot == nil {
		return fmt.Errorf("%w: %s has no network slot", sandbox.ErrGone, i.id)
	}
	if err := i.b.pool.ApplyEgress(ctx, slot, e); err != nil {
		return fmt.Errorf("microvm: %s: %w", i.id, err)
	}
	// The saved state records the slot's internet setting for a restart's adoption.
	return i.saveState()
}

// defaultDNS fills Network.DNS (network.dns, the guests' nameservers) from ResolvConf
// when none is configured: the nameservers guests get on their kernel command line, which
// the network pool lets through its infrastructure deny and the egress proxy resolves with.
func (c *Config) defaultDNS() {
	if len(c.Network.DNS) > 0 {
		return
	}
	for _, s := range nameservers(c.ResolvConf) {
		if ip, err := netip.ParseAddr(s); err == nil {
			c.Network.DNS = append(c.Network.DNS, ip)
		}
	}
}

// guestDNS is Network.DNS as the guest's command line takes it.
func (c *Config) guestDNS() []string {
	out := make([]string, 0, len(c.Network.DNS))
	for _, a := range c.Network.DNS {
		out = append(out, a.String())
	}
	return out
}
