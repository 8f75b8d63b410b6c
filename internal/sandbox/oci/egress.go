package oci

import (
	"context"
	"fmt"

	"github.com/aenv-dev/aenv/internal/sandbox"
)

// UpdateEgress implements sandbox.EgressUpdater on the instance's network slot: outbound
// NAT for AllowInternet, the allow and deny destinations, and the egress proxy for
// domains, request transforms and a SOCKS5 tunnel. It works on a sandbox
// paused in place too (its slot stays); a stopped one has no slot and reports ErrGone.
// The rules live in the node's nftables, not in the container, so the sandbox cannot
// change them, and they go with the slot when it is released.
func (i *Instance) UpdateEgress(ctx context.Context, e sandbox.Egress) error {
	i.mu.Lock()
	slot, stopped := i.slot, i.stopped
	i.mu.Unlock()
	if stopped || slot == nil {
		return fmt.Errorf("%w: %s has no network slot", sandbox.ErrGone, i.id)
	}
	if err := i.b.pool.ApplyEgress(ctx, slot, e); err != nil {
		return fmt.Errorf("oci: %s: %w", i.id, err)
	}
	i.mu.Lock()
	i.allowInternet = e.AllowInternet
	i.mu.Unlock()
	return nil
}
