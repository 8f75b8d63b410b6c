package network

import (
	"context"
	"errors"
	"os"
	"time"

	"github.com/vishvananda/netlink"
	"github.com/vishvananda/netns"
)

// defaultReclaimWait is how long a released slot's veth may take to go with its namespace
// before reclaim deletes it itself: something still holds the namespace (a process that
// entered it, an open descriptor), and only the veth's deletion takes it off the bridge.
const defaultReclaimWait = 5 * time.Second

// release takes apart a slot a sandbox used and reports whether its index is free again.
// It deletes the slot's namespace and leaves the veth to the kernel, which deletes it
// (both ends, its peer being in the namespace) when it tears the namespace down, in a
// worker of its own and in batches: deleting it here held the node's thread ~20 ms
// (RTM_DELLINK waits for RCU grace periods under the kernel's network lock, stalling
// every other slot's setup meanwhile) for ~1.5 ms of the node's CPU. The index stays in
// use until the veth is gone (reclaim), so the next slot of that name cannot collide with
// it; a crash meanwhile leaves a veth without a namespace, which Reconcile sweeps.
func (p *Pool) release(s *Slot) (free bool, err error) {
	p.mu.Lock()
	if p.reclaiming[s.Index] {
		p.mu.Unlock()
		return false, nil // released before
	}
	closed := p.closed
	p.mu.Unlock()
	p.unrouteSlot(s)
	veth, lerr := netlink.LinkByName(s.HostVeth)
	if _, err := os.Lstat(s.NetnsPath); closed || err != nil || lerr != nil || netns.DeleteNamed(s.Netns) != nil {
		return true, p.destroy(s) // half-built, not a mount, or no pool left to wait
	}
	p.mu.Lock()
	if p.closed {
		p.mu.Unlock()
		return true, p.destroy(s)
	}
	p.reclaiming[s.Index] = true
	p.reclaims.Add(1) // under mu, before Close's Wait
	p.mu.Unlock()
	go p.reclaim(s, veth.Attrs().Index)
	return false, nil
}

// Settle waits until the veth of every slot released so far is gone.
func (p *Pool) Settle(ctx context.Context) error {
	for {
		p.mu.Lock()
		n := len(p.reclaiming)
		p.mu.Unlock()
		if n == 0 {
			return nil
		}
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(5 * time.Millisecond):
		}
	}
}

// reclaim frees s's index once its veth (interface index ifindex) is gone.
func (p *Pool) reclaim(s *Slot, ifindex int) {
	defer p.reclaims.Done()
	gone := p.vethGone(s.HostVeth, ifindex)
	p.mu.Lock()
	delete(p.reclaiming, s.Index)
	if gone {
		delete(p.used, s.Index)
	} // else its name is still taken: the index stays used until a restart sweeps it
	p.mu.Unlock()
	p.kick()
}

// vethGone waits for the veth name (interface index ifindex) to go, deleting it itself
// after the pool's reclaimWait or once the pool closes, and reports whether it is gone.
func (p *Pool) vethGone(name string, ifindex int) bool {
	deadline := time.Now().Add(p.reclaimWait)
	for wait := 2 * time.Millisecond; ; wait = min(2*wait, 200*time.Millisecond) {
		l, err := netlink.LinkByIndex(ifindex)
		var nf netlink.LinkNotFoundError
		if errors.As(err, &nf) || err == nil && l.Attrs().Name != name {
			return true
		}
		closing := false
		select {
		case <-p.done:
			closing = true
		default:
		}
		if closing || time.Now().After(deadline) {
			if err != nil {
				p.cfg.Logger.Warn("network: look up a released slot's veth", "veth", name, "err", err)
				return false
			}
			if !closing {
				p.cfg.Logger.Warn("network: a released slot's namespace is still held; deleting its veth", "veth", name)
			}
			if err := netlink.LinkDel(l); err != nil && !errors.As(err, &nf) {
				p.cfg.Logger.Warn("network: delete a released slot's veth", "veth", name, "err", err)
				return false
			}
			return true
		}
		select {
		case <-p.done:
		case <-time.After(wait):
		}
	}
}
